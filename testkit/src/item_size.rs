//! An item's size by DynamoDB's rules, from its wire form (attribute values
//! as `{"S": …}`, `{"N": …}`, …): what a refused conditional write is billed
//! by, since the servers under test report no consumed capacity for one.
//!
//! The rules (DynamoDB developer guide, "Item sizes"): each attribute costs
//! its name's UTF-8 bytes plus its value's size; a string its UTF-8 bytes; a
//! binary its raw bytes; a number about one byte per two significant digits
//! plus one; a boolean or null one byte; a list or map three bytes plus one
//! per element plus the elements (a map's element names included); a set the
//! sum of its elements.

use serde_json::{Map, Value};

/// The size in bytes of `item` (a map of attribute name to typed value).
pub fn item_size(item: &Map<String, Value>) -> usize {
    item.iter()
        .map(|(name, value)| name.len() + value_size(value))
        .sum()
}

/// Write units for a write of an item of `bytes` (1 KB each, at least one).
pub fn write_units(bytes: usize) -> f64 {
    bytes.div_ceil(1024).max(1) as f64
}

fn value_size(value: &Value) -> usize {
    let Some((kind, v)) = value.as_object().and_then(|o| o.iter().next()) else {
        return 0;
    };
    match kind.as_str() {
        "S" => v.as_str().map_or(0, str::len),
        "N" => v.as_str().map_or(0, number_size),
        "B" => v.as_str().map_or(0, binary_size),
        "BOOL" | "NULL" => 1,
        "SS" => each(v, |s| s.as_str().map_or(0, str::len)),
        "NS" => each(v, |s| s.as_str().map_or(0, number_size)),
        "BS" => each(v, |s| s.as_str().map_or(0, binary_size)),
        "L" => 3 + each(v, |e| 1 + value_size(e)),
        "M" => {
            3 + v.as_object().map_or(0, |m| {
                m.iter()
                    .map(|(name, e)| 1 + name.len() + value_size(e))
                    .sum()
            })
        }
        _ => 0,
    }
}

fn each(list: &Value, size: impl Fn(&Value) -> usize) -> usize {
    list.as_array().map_or(0, |l| l.iter().map(size).sum())
}

/// A number's size: one byte per two significant digits (leading and
/// trailing zeros trimmed), plus one.
fn number_size(text: &str) -> usize {
    let mantissa = text.split(['e', 'E']).next().unwrap_or("");
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let significant = digits.trim_start_matches('0').trim_end_matches('0').len();
    significant.div_ceil(2) + 1
}

/// The raw length of a base64 value.
fn binary_size(text: &str) -> usize {
    let padding = text.bytes().rev().take_while(|&b| b == b'=').count();
    (text.len() / 4 * 3).saturating_sub(padding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn size(item: Value) -> usize {
        item_size(item.as_object().unwrap())
    }

    #[test]
    fn sizes_follow_dynamodb_s_rules_for_each_kind() {
        assert_eq!(size(json!({"Pk": {"S": "CONN#a/b"}})), 2 + 8);
        // 123000 has three significant digits: two bytes, plus one.
        assert_eq!(size(json!({"n": {"N": "123000"}})), 1 + 3);
        assert_eq!(size(json!({"n": {"N": "-0.5"}})), 1 + 2);
        assert_eq!(size(json!({"b": {"B": "aGVsbG8="}})), 1 + 5);
        assert_eq!(size(json!({"t": {"BOOL": true}, "z": {"NULL": true}})), 4);
        assert_eq!(size(json!({"s": {"SS": ["ab", "c"]}})), 1 + 3);
        assert_eq!(
            size(json!({"l": {"L": [{"S": "ab"}, {"N": "7"}]}})),
            1 + 3 + 3 + 3
        );
        assert_eq!(
            size(json!({"m": {"M": {"k": {"S": "ab"}}}})),
            1 + 3 + 1 + 1 + 2
        );
    }

    #[test]
    fn a_write_is_billed_by_the_started_kilobyte_and_never_less_than_one() {
        assert_eq!(write_units(0), 1.0);
        assert_eq!(write_units(1024), 1.0);
        assert_eq!(write_units(1025), 2.0);
    }
}
