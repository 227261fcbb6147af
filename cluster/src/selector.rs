//! Label and field selectors, parsed once and matched in memory.
//!
//! The kube backend sends selector strings to the API server unchanged; the embedded
//! backend needs to evaluate them itself, with the same grammar, so that a controller's
//! list/watch returns the same objects on both.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Req {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed Kubernetes label selector (`a=b,c!=d,e in (x,y),!f`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Req>);

impl LabelSelector {
    /// Parses the equality- and set-based syntax the API server accepts.
    pub fn parse(s: &str) -> Result<Self> {
        let mut reqs = Vec::new();
        for part in split_top_level(s)? {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(parse_req(part)?);
        }
        Ok(LabelSelector(reqs))
    }

    /// True when the selector has no requirements (matches everything).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
        self.0.iter().all(|r| match r {
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
            Req::Eq(k, v) => get(k) == Some(v.as_str()),
            Req::NotEq(k, v) => get(k) != Some(v.as_str()),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// Splits on commas that are not inside `( )`.
fn split_top_level(s: &str) -> Result<Vec<&str>> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err(Error::Invalid(format!("unbalanced ')' in selector {s:?}")));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(Error::Invalid(format!("unbalanced '(' in selector {s:?}")));
    }
    out.push(&s[start..]);
    Ok(out)
}

fn check_key(k: &str, whole: &str) -> Result<String> {
    let ok = !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if ok {
        Ok(k.to_string())
    } else {
        Err(Error::Invalid(format!(
            "invalid label key {k:?} in selector {whole:?}"
        )))
    }
}

fn check_value(v: &str, whole: &str) -> Result<String> {
    let ok = v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(v.to_string())
    } else {
        Err(Error::Invalid(format!(
            "invalid label value {v:?} in selector {whole:?}"
        )))
    }
}

fn parse_req(p: &str) -> Result<Req> {
    if let Some(k) = p.strip_prefix('!') {
        return Ok(Req::NotExists(check_key(k.trim(), p)?));
    }
    if let Some(i) = p.find("!=") {
        return Ok(Req::NotEq(
            check_key(p[..i].trim(), p)?,
            check_value(p[i + 2..].trim(), p)?,
        ));
    }
    if let Some(i) = p.find("==") {
        return Ok(Req::Eq(
            check_key(p[..i].trim(), p)?,
            check_value(p[i + 2..].trim(), p)?,
        ));
    }
    if let Some(i) = p.find('=') {
        return Ok(Req::Eq(
            check_key(p[..i].trim(), p)?,
            check_value(p[i + 1..].trim(), p)?,
        ));
    }
    if let Some(open) = p.find('(') {
        let close = p
            .rfind(')')
            .filter(|c| *c > open && p[c + 1..].trim().is_empty());
        let close = close.ok_or_else(|| Error::Invalid(format!("bad set requirement {p:?}")))?;
        let head: Vec<&str> = p[..open].split_whitespace().collect();
        let values = p[open + 1..close]
            .split(',')
            .map(|v| check_value(v.trim(), p))
            .collect::<Result<Vec<_>>>()?;
        return match head.as_slice() {
            [k, "in"] => Ok(Req::In(check_key(k, p)?, values)),
            [k, "notin"] => Ok(Req::NotIn(check_key(k, p)?, values)),
            _ => Err(Error::Invalid(format!("bad set requirement {p:?}"))),
        };
    }
    Ok(Req::Exists(check_key(p.trim(), p)?))
}

/// A parsed field selector (`spec.nodeName=n1,status.phase!=Failed`).
///
/// Which fields are allowed depends on the kind (see [`crate::Object::FIELDS`]); the
/// API server rejects the others, and so does the embedded backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self> {
        let mut reqs = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (field, eq, value) = if let Some(i) = part.find("!=") {
                (&part[..i], false, &part[i + 2..])
            } else if let Some(i) = part.find("==") {
                (&part[..i], true, &part[i + 2..])
            } else if let Some(i) = part.find('=') {
                (&part[..i], true, &part[i + 1..])
            } else {
                return Err(Error::Invalid(format!("invalid field selector {part:?}")));
            };
            reqs.push((field.trim().to_string(), eq, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The field names used, for validation against the kind's supported fields.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(f, _, _)| f.as_str())
    }

    /// The value required by an equality term on `field`, if any (used to pick an index).
    pub fn required_value(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, eq, _)| *eq && f == field)
            .map(|(_, _, v)| v.as_str())
    }

    /// Matches using `get`, which returns a field's value ("" when unset, as the API
    /// server's field sets do).
    pub fn matches(&self, get: impl Fn(&str) -> String) -> bool {
        self.0.iter().all(|(f, eq, v)| (get(f) == *v) == *eq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_selector_grammar() {
        let l = labels(&[("app", "db"), ("tier", "backend")]);
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(Some(&l));
        assert!(m(""));
        assert!(m("app=db"));
        assert!(m("app==db,tier"));
        assert!(!m("app!=db"));
        assert!(m("zone!=x"));
        assert!(m("tier in (frontend, backend)"));
        assert!(!m("tier notin (frontend,backend)"));
        assert!(m("zone notin (a)"));
        assert!(!m("zone in (a)"));
        assert!(m("!zone,app"));
        assert!(!m("!app"));
        assert!(LabelSelector::parse("a in (b").is_err());
        assert!(LabelSelector::parse("a=b c").is_err());
        assert!(!LabelSelector::parse("app=db").unwrap().matches(None));
    }

    #[test]
    fn field_selector_grammar() {
        let f = FieldSelector::parse("spec.nodeName=n1,status.phase!=Failed").unwrap();
        assert_eq!(f.required_value("spec.nodeName"), Some("n1"));
        let get = |phase: &'static str| {
            move |k: &str| {
                if k == "spec.nodeName" {
                    "n1".to_string()
                } else {
                    phase.to_string()
                }
            }
        };
        assert!(f.matches(get("Running")));
        assert!(!f.matches(get("Failed")));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
