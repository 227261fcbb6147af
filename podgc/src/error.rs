//! podgc's error type. The controller ends only on [`Error::Config`], on a watch or Lease
//! it cannot start, or when its task dies; every other failure ends one step of a pass:
//! it is logged and the step is retried next pass.

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A Kubernetes API call failed.
    #[error(transparent)]
    Cluster(#[from] fencecsi_cluster::Error),
    /// Every attempt to quarantine the node met a concurrent change of it.
    #[error("node {node} kept changing; quarantine retried next pass")]
    NodeKeptChanging { node: String },
    /// The controller task panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
