//! Per-key operation exclusion. The CSI spec asks a plugin that is already
//! working on a volume to answer a second concurrent call for it with ABORTED
//! rather than queue it; the CO retries.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::error::CsiError;

#[derive(Clone, Default)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
}

pub struct InFlightGuard {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `key` or answers ABORTED if another operation holds it.
    pub fn try_lock(&self, key: impl Into<String>) -> Result<InFlightGuard, CsiError> {
        let key = key.into();
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if !keys.insert(key.clone()) {
            return Err(CsiError::Aborted(format!(
                "an operation on {key} is already in progress; retry later"
            )));
        }
        Ok(InFlightGuard {
            keys: self.keys.clone(),
            key,
        })
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_aborted_until_release() {
        let f = InFlight::new();
        let g = f.try_lock("vol-a").unwrap();
        assert!(matches!(f.try_lock("vol-a"), Err(CsiError::Aborted(_))));
        let _other = f.try_lock("vol-b").unwrap();
        drop(g);
        assert!(f.try_lock("vol-a").is_ok());
    }
}
