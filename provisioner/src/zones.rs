//! Which zone a machine starts in.
//!
//! - [`allowed`]: only zones its `zones=` constraint names (all the
//!   provider's when it names none); a zone the provider does not have is a
//!   provisioning error naming the zones it has.
//! - [`Spread`]: Juju's distribution groups. A machine hosting units of a
//!   service goes to the allowed zone with the fewest machines hosting units
//!   of that service; ties (and machines hosting no unit) go to the zone
//!   with the fewest machines of the environment, then to the provider's
//!   order. So a service's units spread over its zones however other
//!   services' machines interleave with its own.
//!
//! The zones a machine may use, in this order of preference, are also where
//! a capacity error moves it next: never outside its constraints.

use jujube_state::Machine;
use std::collections::HashMap;

/// The zones `m` may start in, in the provider's order, or the provisioning
/// error when its constraints name a zone the provider does not have.
pub(crate) fn allowed(m: &Machine, zones: &[String]) -> Result<Vec<String>, String> {
    let wanted = m.constraints.zones();
    if wanted.is_empty() {
        return Ok(zones.to_vec());
    }
    let unknown: Vec<String> = wanted
        .iter()
        .filter(|z| !zones.contains(z))
        .map(|z| format!("`{z}`"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "cannot start machine {}: unknown zone {} in `zones={}`; the provider's zones are {}; choose from them with `jujube resolved {} --constraints zones=...`",
            m.id,
            unknown.join(", "),
            wanted.join(","),
            if zones.is_empty() {
                "none".to_string()
            } else {
                zones
                    .iter()
                    .map(|z| format!("`{z}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            m.id
        ));
    }
    Ok(zones
        .iter()
        .filter(|z| wanted.contains(z))
        .cloned()
        .collect())
}

/// Machines per zone, overall and per distribution group (service).
#[derive(Debug, Default)]
pub(crate) struct Spread {
    /// Machine → the services whose units it hosts.
    groups: HashMap<i64, Vec<String>>,
    per_service: HashMap<String, HashMap<String, usize>>,
    total: HashMap<String, usize>,
}

impl Spread {
    /// `counts`: (service, zone, machines) for machines with a recorded
    /// zone; `groups`: the services of the machines about to be placed
    /// and of those placed but not yet recorded.
    pub(crate) fn new(counts: Vec<(String, String, i64)>, groups: Vec<(i64, String)>) -> Spread {
        let mut s = Spread::default();
        for (svc, zone, n) in counts {
            *s.per_service
                .entry(svc)
                .or_default()
                .entry(zone)
                .or_default() += n as usize;
        }
        for (m, svc) in groups {
            s.groups.entry(m).or_default().push(svc);
        }
        s
    }

    /// Counts machine `m` as in `zone`, overall only (its services'
    /// counts come from [`Spread::new`]'s recorded zones).
    pub(crate) fn count_recorded(&mut self, zone: &str) {
        *self.total.entry(zone.to_string()).or_default() += 1;
    }

    /// Counts machine `m` (placed, not yet recorded) as in `zone`.
    pub(crate) fn count_placed(&mut self, m: i64, zone: &str) {
        *self.total.entry(zone.to_string()).or_default() += 1;
        for svc in self.groups.get(&m).into_iter().flatten() {
            *self
                .per_service
                .entry(svc.clone())
                .or_default()
                .entry(zone.to_string())
                .or_default() += 1;
        }
    }

    /// `allowed` in order of preference for machine `m`; the first is
    /// counted as taken.
    pub(crate) fn choose(&mut self, m: i64, allowed: &[String]) -> Vec<String> {
        let empty = Vec::new();
        let services = self.groups.get(&m).unwrap_or(&empty);
        let mut order: Vec<(usize, usize, usize, &String)> = allowed
            .iter()
            .enumerate()
            .map(|(i, z)| {
                let group: usize = services
                    .iter()
                    .map(|s| {
                        self.per_service
                            .get(s)
                            .and_then(|c| c.get(z))
                            .copied()
                            .unwrap_or(0)
                    })
                    .sum();
                (group, self.total.get(z).copied().unwrap_or(0), i, z)
            })
            .collect();
        order.sort();
        let order: Vec<String> = order.into_iter().map(|(_, _, _, z)| z.clone()).collect();
        if let Some(first) = order.first() {
            self.count_placed(m, first);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zones() -> Vec<String> {
        ["zone-a", "zone-b", "zone-c"].map(String::from).to_vec()
    }

    #[test]
    fn a_services_machines_spread_over_zones_whatever_else_is_placed() {
        // Three services whose machines interleave: 1 a, 2 b, 3 c, 4 a ...
        let groups: Vec<(i64, String)> = (1..=9)
            .map(|m| (m, ["a", "b", "c"][(m as usize - 1) % 3].to_string()))
            .collect();
        let mut s = Spread::new(vec![], groups);
        let mut by_service: HashMap<String, Vec<String>> = HashMap::new();
        for m in 1..=9 {
            let z = s.choose(m, &zones())[0].clone();
            by_service
                .entry(["a", "b", "c"][(m as usize - 1) % 3].to_string())
                .or_default()
                .push(z);
        }
        for (svc, mut zs) in by_service {
            zs.sort();
            assert_eq!(zs, zones(), "service {svc}");
        }
    }

    #[test]
    fn recorded_zones_count_and_machines_without_units_fill_the_emptiest_zone() {
        let mut s = Spread::new(
            vec![
                ("a".into(), "zone-a".into(), 2),
                ("a".into(), "zone-b".into(), 1),
            ],
            vec![(7, "a".into())],
        );
        for z in ["zone-a", "zone-a", "zone-b"] {
            s.count_recorded(z);
        }
        assert_eq!(s.choose(7, &zones()), vec!["zone-c", "zone-b", "zone-a"]);
        // No unit: the zone with the fewest machines (c has one now, b one,
        // a two): b before c by the provider's order.
        assert_eq!(s.choose(8, &zones())[0], "zone-b");
    }
}
