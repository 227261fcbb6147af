//! The driver's error type and its mapping onto the gRPC codes the CSI spec
//! names. Module errors (backend, loop devices, mounts, filesystems) convert
//! into it so every RPC answers with one deliberate code.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    Unimplemented(String),
    #[error("{0}")]
    Internal(String),
    /// The plugin is shutting down: the CO retries (on its successor).
    #[error("{0}")]
    Unavailable(String),
}

pub type CsiResult<T> = Result<T, CsiError>;

impl CsiError {
    pub fn code(&self) -> Code {
        match self {
            CsiError::InvalidArgument(_) => Code::InvalidArgument,
            CsiError::NotFound(_) => Code::NotFound,
            CsiError::AlreadyExists(_) => Code::AlreadyExists,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::ResourceExhausted(_) => Code::ResourceExhausted,
            CsiError::OutOfRange(_) => Code::OutOfRange,
            CsiError::Aborted(_) => Code::Aborted,
            CsiError::Unimplemented(_) => Code::Unimplemented,
            CsiError::Internal(_) => Code::Internal,
            CsiError::Unavailable(_) => Code::Unavailable,
        }
    }

    pub fn internal(context: &str, err: impl std::fmt::Display) -> Self {
        CsiError::Internal(format!("{context}: {err}"))
    }
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

impl From<crate::ids::IdError> for CsiError {
    fn from(e: crate::ids::IdError) -> Self {
        CsiError::InvalidArgument(e.to_string())
    }
}

impl From<crate::paths::PathError> for CsiError {
    fn from(e: crate::paths::PathError) -> Self {
        CsiError::InvalidArgument(e.to_string())
    }
}
