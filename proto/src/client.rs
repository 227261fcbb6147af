//! Connecting to a CSI plugin over its unix socket, as a CO or sidecar does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::v1::controller_client::ControllerClient;
use crate::v1::identity_client::IdentityClient;
use crate::v1::node_client::NodeClient;

/// Request header by which a caller says it understands the fence
/// extensions; plugins may show `UNPUBLISH_FENCE`/`FORCE_UNPUBLISH` only then.
pub const EXTENSIONS_HEADER: &str = "x-fencecsi-extensions";

/// Wraps a request so the plugin shows the fence extensions.
pub fn with_extensions<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert(
        EXTENSIONS_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    r
}

/// Turns `unix:///path` or a plain absolute path into the socket path.
pub fn socket_path(endpoint: &str) -> PathBuf {
    PathBuf::from(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

/// A channel to the plugin at `socket`. The channel reconnects by itself
/// when the plugin restarts (each new connection dials the socket again).
pub async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_path_buf();
    // The URI is required by the API but unused: every connection goes to the socket.
    Endpoint::from_static("http://fencecsi.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// A lazily connecting channel (for controllers that start before the plugin).
pub fn connect_lazy(socket: &Path) -> Channel {
    let path = socket.to_path_buf();
    Endpoint::from_static("http://fencecsi.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
}

/// The three CSI services on one channel.
#[derive(Clone)]
pub struct CsiClient {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl CsiClient {
    pub fn new(channel: Channel) -> Self {
        Self {
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }

    pub async fn connect(socket: &Path) -> Result<Self, tonic::transport::Error> {
        Ok(Self::new(connect(socket).await?))
    }
}
