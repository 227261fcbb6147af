//! The plugin's unix socket, and the error of serving on it: shared by the
//! server and the controller's leadership (which binds the socket only
//! while it leads).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tokio::net::UnixListener;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Binds the socket: removes a stale socket left by a crash (never a regular
/// file or directory someone else put there) and sets its mode to 0660.
pub fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |what: String| move |source| ServeError::Io { what, source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(io(format!("removing stale socket {}", path.display())))?,
        Ok(_) => {
            return Err(ServeError::Config(format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            )))
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(io(format!("chmod {}", path.display())))?;
    Ok(listener)
}
