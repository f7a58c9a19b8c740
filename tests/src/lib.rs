//! metrale-e2e: tests that cross crates (see `tests/tests/`): the toolchain end to end (targets, closure
//! hashing and the cache, reproducibility across clones, auditing a real built binary, loading built
//! blobs on a GPU when one is present). The library itself is empty; each test file is self-contained.
