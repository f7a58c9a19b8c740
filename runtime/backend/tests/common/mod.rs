//! Helpers shared by the GPU test files (each file under tests/ is its own crate).

/// The repository's `targets/` folder: `$METRALE_TARGETS`, else the first `targets/` above the working
/// directory (tests run from the crate folder here and from the repo root on the GPU machine).
pub fn targets_root() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("METRALE_TARGETS") {
        return p.into();
    }
    let mut dir = std::env::current_dir().unwrap();
    loop {
        if dir.join("targets").is_dir() {
            return dir.join("targets");
        }
        if !dir.pop() {
            panic!("targets/ not found above the working directory; set METRALE_TARGETS");
        }
    }
}
