//! fencecsi podgc (built in its own issue).
