//! Checks on the target and staging paths a CO hands us. The plugin only ever
//! creates, mounts or removes things below its allowed roots (the kubelet
//! directory), so a path is accepted only if it is absolute, has no `.`/`..`
//! components, and, after resolving symlinks in its existing ancestors, still
//! lies under a root.

use std::path::{Component, Path, PathBuf};

/// Linux limits: a whole path (with its NUL) and one component.
const PATH_MAX: usize = 4096;
const NAME_MAX: usize = 255;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("{what} is required")]
    Missing { what: &'static str },
    #[error("{what} {path:?} must be an absolute path without '.' or '..' components")]
    NotNormal { what: &'static str, path: String },
    #[error("{what} is too long: at most {PATH_MAX} bytes, each component at most {NAME_MAX}")]
    TooLong { what: &'static str },
    #[error("{what} {path:?} is outside the allowed roots {roots:?}")]
    OutsideRoots {
        what: &'static str,
        path: String,
        roots: Vec<PathBuf>,
    },
}

#[derive(Debug, Clone)]
pub struct AllowedRoots {
    roots: Vec<PathBuf>,
}

impl AllowedRoots {
    /// Roots are canonicalised once; a root that does not exist yet is kept
    /// as given (it must then be created by whoever owns it).
    pub fn new(roots: impl IntoIterator<Item = PathBuf>) -> Self {
        let roots = roots
            .into_iter()
            .map(|r| r.canonicalize().unwrap_or(r))
            .collect();
        Self { roots }
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    pub fn check(&self, what: &'static str, raw: &str) -> Result<PathBuf, PathError> {
        if raw.is_empty() {
            return Err(PathError::Missing { what });
        }
        let path = Path::new(raw);
        let normal = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
            && !raw.contains('\0');
        if !normal {
            return Err(PathError::NotNormal {
                what,
                path: raw.chars().take(256).collect(),
            });
        }
        // Refused here rather than by mkdir(2) half-way through staging,
        // after the loop device is attached and the volume formatted.
        if raw.len() >= PATH_MAX || path.components().any(|c| c.as_os_str().len() > NAME_MAX) {
            return Err(PathError::TooLong { what });
        }
        let resolved = resolve_existing_prefix(path);
        // The path must be strictly below a root: the root itself is never ours to mount over.
        if self
            .roots
            .iter()
            .any(|r| resolved.starts_with(r) && resolved != *r)
        {
            Ok(path.to_path_buf())
        } else {
            Err(PathError::OutsideRoots {
                what,
                path: raw.to_string(),
                roots: self.roots.clone(),
            })
        }
    }
}

/// Canonicalises the longest existing ancestor and appends the rest, so a
/// symlink planted in an existing parent cannot lead outside a root.
pub(crate) fn resolve_existing_prefix(path: &Path) -> PathBuf {
    let mut existing = path.to_path_buf();
    let mut rest = Vec::new();
    loop {
        // A stale mountpoint fails canonicalize with EIO/ENOTCONN; treat it as
        // the last component and keep its parent's resolution.
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for part in rest.iter().rev() {
                out.push(part);
            }
            return out;
        }
        match (
            existing.file_name().map(|s| s.to_owned()),
            existing.parent(),
        ) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                existing = parent.to_path_buf();
            }
            _ => return path.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_paths_below_a_root_and_refuses_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kubelet");
        std::fs::create_dir(&root).unwrap();
        let roots = AllowedRoots::new([root.clone()]);
        let ok = root.join("pods/uid/volumes/x/mount");
        assert_eq!(
            roots.check("target path", ok.to_str().unwrap()).unwrap(),
            ok
        );
        for bad in ["relative/path", "/etc/passwd", "", root.to_str().unwrap()] {
            assert!(roots.check("target path", bad).is_err(), "{bad:?}");
        }
        let long_name = root.join("a".repeat(256));
        let long_path = root.join("abcdefg/".repeat(600));
        for bad in [long_name, long_path] {
            assert_eq!(
                roots.check("target path", bad.to_str().unwrap()),
                Err(PathError::TooLong {
                    what: "target path"
                })
            );
        }
        let traversal = format!("{}/../../etc", root.display());
        assert!(matches!(
            roots.check("target path", &traversal),
            Err(PathError::NotNormal { .. })
        ));
    }

    #[test]
    fn symlink_out_of_the_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kubelet");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("evil")).unwrap();
        let roots = AllowedRoots::new([root.clone()]);
        let p = root.join("evil/target");
        assert!(matches!(
            roots.check("target path", p.to_str().unwrap()),
            Err(PathError::OutsideRoots { .. })
        ));
    }
}
