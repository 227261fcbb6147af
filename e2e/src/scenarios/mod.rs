//! The scenarios, each asserting real outcomes on the running cluster.

pub mod day2;
pub mod evidence;
pub mod expansion;
pub mod failover;
pub mod install;
pub mod leader;
pub mod least_privilege;
pub mod snapshot;
pub mod writer;
