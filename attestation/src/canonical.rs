//! Canonical JSON: object keys sorted by their UTF-8 bytes, no insignificant whitespace, numbers as
//! serde_json prints them. Used for every hash over structured data (closure manifests, the kernel set)
//! so a hash never depends on map iteration order or on whether serde_json's `preserve_order` feature
//! happens to be enabled in a build.

use serde_json::Value;

/// The canonical encoding of `v`.
pub fn to_string(v: &Value) -> String {
    let mut out = String::new();
    write(v, &mut out);
    out
}

/// Serializes `t` to a JSON value, then canonically.
pub fn encode<T: serde::Serialize>(t: &T) -> Result<String, serde_json::Error> {
    Ok(to_string(&serde_json::to_value(t)?))
}

fn write(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                write(&m[*k], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn keys_sorted_recursively() {
        let v: Value =
            serde_json::from_str(r#"{"b":1,"a":{"d":[{"z":1,"y":2}],"c":"x"}}"#).unwrap();
        assert_eq!(
            to_string(&v),
            r#"{"a":{"c":"x","d":[{"y":2,"z":1}]},"b":1}"#
        );
    }
}
