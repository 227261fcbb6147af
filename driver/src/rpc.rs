//! Running an RPC's body: the services' work is blocking (files, ioctls,
//! mkfs, clones), so it runs on the blocking pool, and every call's outcome
//! is logged with its duration and gRPC code.

use tonic::{Response, Status};

use crate::error::CsiResult;

/// Runs `f` on the blocking pool and logs its outcome as `rpc`.
pub async fn blocking<T: Send + 'static>(
    rpc: &'static str,
    f: impl FnOnce() -> CsiResult<T> + Send + 'static,
) -> Result<Response<T>, Status> {
    let start = std::time::Instant::now();
    let result = tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("{rpc} panicked: {e}")))?;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(v) => {
            tracing::debug!(rpc, ms, "ok");
            Ok(Response::new(v))
        }
        Err(e) => {
            tracing::warn!(rpc, ms, code = ?e.code(), error = %e, "failed");
            Err(e.into())
        }
    }
}
