//! Target specifications (TODO toolchain helper).
