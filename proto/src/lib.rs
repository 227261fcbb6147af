//! CSI v1.12.0 protocol bindings plus the fencecsi fence extensions.
//!
//! The extensions (`UNPUBLISH_FENCE`, `ControllerUnpublishVolumeRequest.fence`,
//! `FORCE_UNPUBLISH`, `force` on the node unpublish/unstage requests) are all
//! numbered 1000; see `proto/README.md` for why that keeps standard peers working.

#[allow(clippy::all, missing_docs)]
pub mod csi {
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

pub use csi::v1;

/// The CSI spec version these bindings implement.
pub const CSI_SPEC_VERSION: &str = "1.12.0";

pub mod client;
