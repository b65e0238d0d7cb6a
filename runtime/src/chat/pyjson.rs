//! `json.dumps` as Python writes it, for the `tojson` filter of chat templates (transformers
//! calls `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
//! sort_keys=sort_keys)`): `", "` and `": "` separators without indent, `","` and `": "` with
//! one, non-ASCII kept, `<>&` not escaped, floats as Python's `repr`, keys in insertion order.

use serde_json::Value;

/// Options of Python's `json.dumps` that templates pass.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub indent: Option<usize>,
    pub sort_keys: bool,
    /// `(item separator, key separator)`; defaults as Python's.
    pub separators: Option<(String, String)>,
}

pub fn dumps(value: &Value, opts: &DumpOptions) -> String {
    let item = if opts.indent.is_some() { "," } else { ", " };
    let (item, key) = (opts.separators.clone()).unwrap_or((item.into(), ": ".into()));
    let mut out = String::new();
    write(value, opts, &item, &key, 0, &mut out);
    out
}

fn write(value: &Value, opts: &DumpOptions, item: &str, key: &str, depth: usize, out: &mut String) {
    let (open, close, entries): (char, char, Vec<(Option<&String>, &Value)>) = match value {
        Value::Null => return out.push_str("null"),
        Value::Bool(b) => return out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => return out.push_str(&python_number(n)),
        Value::String(s) => return write_str(s, out),
        Value::Array(items) => ('[', ']', items.iter().map(|v| (None, v)).collect()),
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().map(|(k, v)| (Some(k), v)).collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            ('{', '}', entries)
        }
    };
    out.push(open);
    if entries.is_empty() {
        return out.push(close);
    }
    let newline = |depth: usize, out: &mut String| {
        if let Some(indent) = opts.indent {
            out.push('\n');
            out.push_str(&" ".repeat(indent * depth));
        }
    };
    for (i, (k, v)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push_str(item);
        }
        newline(depth + 1, out);
        if let Some(k) = k {
            write_str(k, out);
            out.push_str(key);
        }
        write(v, opts, item, key, depth + 1, out);
    }
    newline(depth, out);
    out.push(close);
}

/// A JSON string as Python writes it with `ensure_ascii=False`: the same escapes as serde_json's
/// (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control characters as `\u00XX`).
fn write_str(s: &str, out: &mut String) {
    out.push_str(&serde_json::to_string(s).expect("a string serializes"));
}

/// Integers as written; floats as Python's `repr` (shortest round-trip, `1.0`, `1e-05`, `1e+16`).
/// A JSON number is never NaN or infinite.
fn python_number(n: &serde_json::Number) -> String {
    let Some(f) = n.as_f64().filter(|_| n.is_f64()) else {
        return n.to_string();
    };
    // Rust's `{:e}` is the shortest round-trip digits; Python switches to exponent notation
    // below 1e-4 and at or above 1e16, as Rust's `{:?}` does (which also writes `1.0`).
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    if (-4..16).contains(&exp) {
        format!("{f:?}")
    } else {
        format!("{mantissa}e{exp:+03}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_json_dumps() {
        // Expected strings are what CPython 3.11's json.dumps(..., ensure_ascii=False) prints.
        let v = json!({"name": "get_weather", "b": [1, 2.5, 1e-05, 1e16, 3.0, true, null], "s": "é\n\"<&>\u{1}"});
        assert_eq!(
            dumps(&v, &DumpOptions::default()),
            "{\"name\": \"get_weather\", \"b\": [1, 2.5, 1e-05, 1e+16, 3.0, true, null], \"s\": \"é\\n\\\"<&>\\u0001\"}"
        );
        let v = json!({"a": [1, {"b": []}], "c": {}});
        assert_eq!(
            dumps(
                &v,
                &DumpOptions {
                    indent: Some(2),
                    ..Default::default()
                }
            ),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ],\n  \"c\": {}\n}"
        );
        let v = json!({"z": 1, "a": 2});
        assert_eq!(
            dumps(
                &v,
                &DumpOptions {
                    sort_keys: true,
                    ..Default::default()
                }
            ),
            "{\"a\": 2, \"z\": 1}"
        );
        assert_eq!(
            python_number(&serde_json::Number::from_f64(0.0001).unwrap()),
            "0.0001"
        );
        assert_eq!(
            python_number(&serde_json::Number::from_f64(123456.789).unwrap()),
            "123456.789"
        );
    }
}
