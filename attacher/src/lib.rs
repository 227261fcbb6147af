//! fencecsi attacher (built in its own issue).
