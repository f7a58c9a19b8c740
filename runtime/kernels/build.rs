//! Embeds the kernel pack named by env METRALE_KERNEL_PACK (written by `cargo xtask build-target`).
//! Without it the pack is empty and the registry is the CPU-only one, so a plain `cargo build` or
//! `cargo test` works on any machine. The pack is copied into OUT_DIR with its length, so lib.rs can
//! place it in a fixed-size static in the `.metrale` section.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=METRALE_KERNEL_PACK");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let bytes = match std::env::var_os("METRALE_KERNEL_PACK") {
        Some(p) if !p.is_empty() => {
            let p = PathBuf::from(p);
            println!("cargo:rerun-if-changed={}", p.display());
            match std::fs::read(&p) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("error: METRALE_KERNEL_PACK={}: {e}. Build targets with `cargo xtask build-target`, or unset it for a CPU-only build.", p.display());
                    std::process::exit(1);
                }
            }
        }
        _ => Vec::new(),
    };
    let write_if_changed = |name: &str, data: &[u8]| {
        let p = out.join(name);
        if std::fs::read(&p).ok().as_deref() != Some(data) {
            std::fs::write(&p, data).expect("writing into OUT_DIR");
        }
    };
    write_if_changed("pack.bin", &bytes);
    write_if_changed(
        "pack_len.rs",
        format!(
            "/// Length of the embedded pack.\npub const PACK_LEN: usize = {};\n",
            bytes.len()
        )
        .as_bytes(),
    );
}
