//! The JSON pieces of tool calls: where a JSON value ends in a text, JSON written the way the
//! templates write it (their `tojson`: Python's `json.dumps`, `", "` and `": "`), and a call
//! read from a parsed value.

use serde_json::{Map, Value};

/// Where the JSON object or array opening `s` ends (the byte after its closing bracket);
/// `None` when `s` does not start with `{` or `[` or ends first. Only brackets and strings
/// are followed: whether the inside is valid JSON is the parser's business.
pub fn json_end(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    if !matches!(bytes.first(), Some(b'{' | b'[')) {
        return None;
    }
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it: what chat templates'
/// `tojson` gives (the template's own writer), so what models saw in training.
pub fn py_json(v: &Value) -> String {
    crate::text::template::tojson_text(v)
}

/// A call's name and arguments from a parsed value: an object with a non-empty string
/// `name` and its arguments under `arguments` (or `parameters`, Llama's key): an object, a
/// JSON string holding an object, or absent/null for no arguments. `None` for anything else.
pub fn call_from_value(v: &Value) -> Option<(String, Value)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Value::Object(m),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name.to_string(), args))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_end_follows_brackets_and_strings() {
        assert_eq!(json_end(r#"{"a": 1} tail"#), Some(8));
        assert_eq!(json_end(r#"[{"a": "}]"}, 2]x"#), Some(16));
        assert_eq!(json_end(r#"{"a": "\"}"}"#), Some(12));
        assert_eq!(json_end(r#"{"a": "\\"}"#), Some(11));
        assert_eq!(json_end(r#"{"a": {"b": 1}"#), None);
        assert_eq!(json_end("x{}"), None);
        assert_eq!(json_end(""), None);
        assert_eq!(json_end("{\"é\": \"}\"}"), Some(11));
    }

    #[test]
    fn py_json_uses_python_separators() {
        let v = json!({"name": "f", "arguments": {"a": [1, 2.5, null], "b": "x, y: z"}});
        assert_eq!(
            py_json(&v),
            r#"{"name": "f", "arguments": {"a": [1, 2.5, null], "b": "x, y: z"}}"#
        );
        assert_eq!(py_json(&json!({})), "{}");
        assert_eq!(py_json(&json!("é\n")), "\"é\\n\"");
    }

    #[test]
    fn calls_are_read_leniently_and_come_out_strict() {
        let call = |v: Value| call_from_value(&v);
        let args = json!({"city": "Paris"});
        let want = Some(("f".to_string(), args.clone()));
        assert_eq!(call(json!({"name": "f", "arguments": args})), want);
        assert_eq!(call(json!({"name": "f", "parameters": args})), want);
        assert_eq!(
            call(json!({"name": " f ", "arguments": "{\"city\": \"Paris\"}"})),
            want
        );
        let none = Some(("f".to_string(), json!({})));
        assert_eq!(call(json!({"name": "f"})), none);
        assert_eq!(call(json!({"name": "f", "arguments": null})), none);
        assert_eq!(call(json!({"name": "f", "arguments": ""})), none);
        assert_eq!(call(json!({"name": "f", "arguments": "[1]"})), None);
        assert_eq!(call(json!({"name": "f", "arguments": [1]})), None);
        assert_eq!(call(json!({"name": "", "arguments": {}})), None);
        assert_eq!(call(json!({"name": 3})), None);
        assert_eq!(call(json!(["f"])), None);
    }
}
