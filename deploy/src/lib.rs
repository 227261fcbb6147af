//! fencecsi's Kubernetes manifests live beside this crate (`deploy/base`, `deploy/kind`,
//! `deploy/Dockerfile`); the crate exists so that `cargo test -p fencecsi-deploy` checks
//! them against the code: see `tests/manifests.rs`.
