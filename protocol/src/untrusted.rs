//! Text that a peer chose (a node name heard on mDNS or sent in a handshake, a rejection's
//! reason) ends up on terminals and in log lines. Anyone on the LAN can send such text
//! without the key, so it could carry an ANSI escape that recolours or clears a terminal, a
//! carriage return that overwrites what came before, a line feed that forges a log line of
//! its own, or a bidirectional override that shows a name other than the one sent.
//! `escape` makes it inert: those characters are written as Rust-style escapes (`\n`,
//! `\u{1b}`), and a backslash as `\\`, so two different names never look the same.
//! Everything else, accented letters and other scripts included, is kept as it is.

use std::borrow::Cow;
use std::fmt::Write;

/// `s` with every character a terminal or a log reader would act on (controls, line and
/// paragraph separators, invisible and direction-changing format characters) and the
/// backslash escaped; borrowed unchanged when there is nothing to escape (the usual case).
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => {
                // Writing to a String cannot fail.
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether `escape` rewrites `c`.
fn needs_escape(c: char) -> bool {
    c == '\\'
        || c.is_control()
        || matches!(c,
            // Line and paragraph separators (some terminals and log viewers break lines there).
            '\u{2028}' | '\u{2029}'
            // Zero-width and direction marks, joiners, word joiner and invisible operators.
            | '\u{200b}'..='\u{200f}' | '\u{2060}'..='\u{2064}' | '\u{feff}'
            // Direction embeddings, overrides and isolates; the Arabic letter mark.
            | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{061c}'
            // Interlinear annotation characters.
            | '\u{fff9}'..='\u{fffb}')
}

#[cfg(test)]
mod tests {
    use super::escape;
    use std::borrow::Cow;

    #[test]
    fn plain_names_are_borrowed_unchanged() {
        for s in ["node-a", "Desk PC 7701", "bürø-ноутбук", "東京", ""] {
            assert!(matches!(escape(s), Cow::Borrowed(b) if b == s), "{s}");
        }
    }

    #[test]
    fn escapes_bells_returns_line_feeds_and_ansi_sequences() {
        assert_eq!(
            escape("a\x1b[31mred\x07\r\nINFO forged"),
            "a\\u{1b}[31mred\\u{7}\\r\\nINFO forged"
        );
        assert_eq!(
            escape("tab\there\u{9b}2J\u{7f}"),
            "tab\\there\\u{9b}2J\\u{7f}"
        );
    }

    #[test]
    fn escapes_direction_overrides_and_invisible_characters() {
        assert_eq!(escape("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
        assert_eq!(
            escape("a\u{200b}b\u{feff}\u{2028}"),
            "a\\u{200b}b\\u{feff}\\u{2028}"
        );
    }

    #[test]
    fn a_backslash_is_escaped_so_an_escape_cannot_be_forged() {
        // The name `a\n` typed with a real backslash must not show as the name "a" + LF does.
        assert_eq!(escape("a\\n"), "a\\\\n");
        assert_ne!(escape("a\\n"), escape("a\n"));
    }

    #[test]
    fn the_output_has_no_control_characters_for_any_char() {
        for c in (0u32..0x3000).filter_map(char::from_u32) {
            let s = c.to_string();
            let e = escape(&s);
            assert!(
                e.chars().all(|x| !x.is_control() && x != '\u{202e}'),
                "U+{:04x}",
                c as u32
            );
        }
    }
}
