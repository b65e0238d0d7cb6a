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
    let (item, key) = opts.separators.clone().unwrap_or_else(|| {
        if opts.indent.is_some() {
            (",".into(), ": ".into())
        } else {
            (", ".into(), ": ".into())
        }
    });
    let mut out = String::new();
    write(value, opts, &item, &key, 0, &mut out);
    out
}

fn newline(opts: &DumpOptions, depth: usize, out: &mut String) {
    if let Some(indent) = opts.indent {
        out.push('\n');
        out.push_str(&" ".repeat(indent * depth));
    }
}

fn write(value: &Value, opts: &DumpOptions, item: &str, key: &str, depth: usize, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&python_number(n)),
        Value::String(s) => write_str(s, out),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(opts, depth + 1, out);
                write(v, opts, item, key, depth + 1, out);
            }
            newline(opts, depth, out);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(opts, depth + 1, out);
                write_str(k, out);
                out.push_str(key);
                write(v, opts, item, key, depth + 1, out);
            }
            newline(opts, depth, out);
            out.push('}');
        }
    }
}

fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Integers as written; floats as Python's `repr` (shortest round-trip, `1.0`, `1e-05`, `1e+16`).
fn python_number(n: &serde_json::Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` is the shortest round-trip digits; Python switches to exponent notation
    // below 1e-4 and at or above 1e16.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exp < 0 { "-" } else { "+" };
        format!("{mantissa}e{sign}{:02}", exp.abs())
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
