//! The lifecycle every machine, unit, service and relation goes through.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Alive → Dying → Dead. An entity starts Alive and never goes back.
///
/// The numeric values are stored in the state database, and their order is
/// the order of the lifecycle, so "advance only" is `new >= old`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Life {
    Alive = 0,
    Dying = 1,
    Dead = 2,
}

impl Life {
    pub fn as_str(self) -> &'static str {
        match self {
            Life::Alive => "alive",
            Life::Dying => "dying",
            Life::Dead => "dead",
        }
    }

    /// The value stored in the database.
    pub fn code(self) -> i64 {
        self as i64
    }

    /// Decodes a stored value; `None` for anything a migration never wrote.
    pub fn from_code(code: i64) -> Option<Life> {
        match code {
            0 => Some(Life::Alive),
            1 => Some(Life::Dying),
            2 => Some(Life::Dead),
            _ => None,
        }
    }

    /// True when moving from `self` to `next` respects the lifecycle.
    pub fn can_become(self, next: Life) -> bool {
        next >= self
    }
}

impl fmt::Display for Life {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn life_only_moves_forward() {
        assert!(Life::Alive.can_become(Life::Dying));
        assert!(Life::Alive.can_become(Life::Dead));
        assert!(Life::Dying.can_become(Life::Dead));
        assert!(!Life::Dead.can_become(Life::Dying));
        assert!(!Life::Dying.can_become(Life::Alive));
        for l in [Life::Alive, Life::Dying, Life::Dead] {
            assert_eq!(Life::from_code(l.code()), Some(l));
        }
        assert_eq!(Life::from_code(3), None);
    }
}
