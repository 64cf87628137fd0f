//! Messages a cluster file's author can act on: `file:line:` prefixes from TOML spans, the
//! table a line sits in, "did you mean" for misspelt fields, and serde's type names in plain
//! words.

use toml::Spanned;

use super::file::TOP_FIELDS;

/// The text being parsed, for turning byte offsets into `file:line:` prefixes.
pub(super) struct Source<'a> {
    pub(super) text: &'a str,
    pub(super) file: String,
}

impl Source<'_> {
    pub(super) fn line_of(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    pub(super) fn at(&self, line: usize, msg: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("{}:{}: {}", self.file, line, msg)
    }

    pub(super) fn err<T>(&self, v: &Spanned<T>, msg: impl std::fmt::Display) -> anyhow::Error {
        self.at(self.line_of(v.span().start), msg)
    }

    /// Text of a 1-based line, or "" past the end.
    pub(super) fn line_text(&self, line: usize) -> &str {
        self.text.lines().nth(line.saturating_sub(1)).unwrap_or("")
    }

    /// Describes the table that holds `line`: the nearest header above it.
    pub(super) fn table_at(&self, line: usize) -> String {
        for l in (1..=line).rev() {
            let code = strip_comment(self.line_text(l));
            if code.starts_with("[[") {
                return format!("in the {code} table at line {l}: ");
            }
            if code.starts_with('[') {
                return format!("in {code}: ");
            }
        }
        String::new()
    }

    /// A TOML syntax, type or unknown-field error as `file:line: message`, naming the field.
    pub(super) fn toml_error(&self, e: &toml::de::Error) -> anyhow::Error {
        let msg = e.message().trim_end();
        let Some(span) = e.span() else {
            return anyhow::anyhow!("{}: {}", self.file, msg);
        };
        let line = self.line_of(span.start);
        if let Some(field) = between(msg, "unknown field `", "`") {
            let expected = backticked(msg.split_once("expected").map_or("", |(_, rest)| rest));
            let mut text = format!("{}unknown field `{field}`", self.table_at(line));
            if let Some(best) = closest(field, &expected) {
                text += &format!(" — did you mean `{best}`?");
            } else if TOP_FIELDS.contains(&field) {
                text += " — top-level settings must come before the first [table] header; move \
                         the line up";
            }
            if !expected.is_empty() {
                text += &format!(" (known fields: {})", expected.join(", "));
            }
            return self.at(line, text);
        }
        let code = strip_comment(self.line_text(line));
        let mut text = match code.split_once('=') {
            Some((k, _)) if !k.trim().is_empty() && !k.contains('[') => {
                format!(
                    "field `{}`: {}",
                    k.trim().trim_matches('"'),
                    plain_types(msg)
                )
            }
            _ => plain_types(msg),
        };
        if msg.contains("expected a sequence") && code.starts_with('[') && !code.starts_with("[[") {
            text += &format!(" — write [{code}] (double brackets) for each table of the list");
        }
        self.at(line, text)
    }
}

/// Serde's Rust type names in words a cluster file's author knows.
pub(super) fn plain_types(msg: &str) -> String {
    msg.replace("expected i64", "expected a whole number")
        .replace("expected a boolean", "expected true or false")
}

/// `type_str` with its article: "an array", "a string".
pub(super) fn a_type(v: &toml::Value) -> String {
    let t = v.type_str();
    let article = if t.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {t}")
}

pub(super) fn strip_comment(line: &str) -> &str {
    line.split('#').next().unwrap_or("").trim()
}

/// 1-based lines that are `[[node]]` headers (spaces and a trailing comment allowed).
pub(super) fn node_header_lines(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let compact: String = strip_comment(l)
                .chars()
                .filter(|c| !c.is_whitespace())
                .collect();
            (compact == "[[node]]").then_some(i + 1)
        })
        .collect()
}

/// The text between the first `open` and the next `close` after it.
pub(super) fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let rest = &s[s.find(open)? + open.len()..];
    Some(&rest[..rest.find(close)?])
}

/// Every `quoted` word of `s`.
pub(super) fn backticked(s: &str) -> Vec<&str> {
    s.split('`').skip(1).step_by(2).collect()
}

/// The candidate nearest to `word` if within edit distance 2 (ties: the first).
pub(super) fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let w = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| (edit_distance(&w, &c.to_ascii_lowercase()), *c))
        .filter(|&(d, _)| d <= 2)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Levenshtein distance over chars.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = (diag + usize::from(ca != cb)).min(up + 1).min(row[j] + 1);
            diag = up;
        }
    }
    row[b.len()]
}
