//! Element types (TODO model helper).
