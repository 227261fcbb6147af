//! Typed errors shared by both backends.
//!
//! Controllers branch on the *kind* of failure (retry on `Conflict`, treat `NotFound` as
//! done, give up on `Invalid`), never on message text, so both backends map their failures
//! onto the same small set of variants.

/// An error from a cluster call, the same for the embedded and the kube backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The object does not exist (HTTP 404).
    #[error("not found: {0}")]
    NotFound(String),
    /// An object with that name already exists (HTTP 409, reason AlreadyExists).
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// Optimistic-concurrency failure: stale resourceVersion, or a uid/resourceVersion
    /// precondition that did not match (HTTP 409).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The request or object is malformed or not allowed by validation (HTTP 400/422).
    #[error("invalid: {0}")]
    Invalid(String),
    /// The caller may not do this (HTTP 403).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// Anything else: transport failures, server errors, timeouts.
    #[error("cluster error: {0}")]
    Other(String),
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound(_))
    }
    pub fn is_already_exists(&self) -> bool {
        matches!(self, Error::AlreadyExists(_))
    }
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Conflict(_))
    }
    pub fn is_invalid(&self) -> bool {
        matches!(self, Error::Invalid(_))
    }
    pub fn is_forbidden(&self) -> bool {
        matches!(self, Error::Forbidden(_))
    }
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(status) => from_status(&status),
            other => Error::Other(chain(&other)),
        }
    }
}

/// The error and its sources ("connect failed: connection refused"): kube's transport
/// errors put the useful part in the source chain.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}

/// Maps an API server `Status` onto our variants. Shared with the watch loop, which sees
/// statuses inside ERROR watch events rather than as `kube::Error`.
pub(crate) fn from_status(s: &kube::core::Status) -> Error {
    let msg = if s.message.is_empty() {
        s.reason.clone()
    } else {
        s.message.clone()
    };
    match (s.code, s.reason.as_str()) {
        (404, _) => Error::NotFound(msg),
        (409, "AlreadyExists") => Error::AlreadyExists(msg),
        (409, _) => Error::Conflict(msg),
        (400, _) | (422, _) => Error::Invalid(msg),
        (403, _) => Error::Forbidden(msg),
        (code, reason) => Error::Other(format!("{code} {reason}: {msg}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> kube::core::Status {
        kube::core::Status {
            code,
            reason: reason.into(),
            message: "m".into(),
            ..Default::default()
        }
    }

    #[test]
    fn maps_status_codes() {
        assert!(from_status(&status(404, "NotFound")).is_not_found());
        assert!(from_status(&status(409, "AlreadyExists")).is_already_exists());
        assert!(from_status(&status(409, "Conflict")).is_conflict());
        assert!(from_status(&status(422, "Invalid")).is_invalid());
        assert!(from_status(&status(400, "BadRequest")).is_invalid());
        assert!(from_status(&status(403, "Forbidden")).is_forbidden());
        assert!(matches!(
            from_status(&status(500, "InternalError")),
            Error::Other(_)
        ));
    }
}
