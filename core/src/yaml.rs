//! What YAML text is read at all: the YAML reader's scanner takes time
//! quadratic in how deep flow collections (`[`, `{`) nest (a 128 KB file of
//! brackets took 10 s), so text nesting deeper than [`MAX_FLOW_DEPTH`] is
//! refused before it is parsed.

/// The deepest `[`/`{` nesting YAML text may have to be read. Charms' files
/// and hook tools' settings nest a few levels.
pub const MAX_FLOW_DEPTH: usize = 64;

/// Whether `text` nests `[` and `{` deeper than [`MAX_FLOW_DEPTH`]. Counted
/// over the raw text, quoted or not: brackets in a string count too, so a
/// string of 65 unclosed brackets is refused with the rest (a closing one
/// that closes nothing counts for nothing).
pub fn too_deep(text: &str) -> bool {
    let mut depth = 0usize;
    for b in text.bytes() {
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_is_counted_over_brackets_and_braces() {
        assert!(!too_deep(
            "summary: [a, {b: [c]}]\ndescription: see [1] and ]]]"
        ));
        let at = format!(
            "{}{}",
            "[".repeat(MAX_FLOW_DEPTH),
            "]".repeat(MAX_FLOW_DEPTH)
        );
        assert!(!too_deep(&at));
        assert!(too_deep(&format!(
            "x: {}",
            "[{".repeat(MAX_FLOW_DEPTH / 2 + 1)
        )));
        // Depth, not count: many shallow collections are fine.
        assert!(!too_deep(&"[a] {b: c} ".repeat(100_000)));
    }
}
