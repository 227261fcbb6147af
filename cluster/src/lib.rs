//! fencecsi cluster (built in its own issue).
