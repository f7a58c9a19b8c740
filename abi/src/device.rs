//! The structs the host writes into device memory for a kernel to read: declared here as `#[repr(C)]`
//! Rust structs and rendered, field for field, into the `abi` namespace of every template (the
//! `{{> abi}}` partial), with a `static_assert` on their size.

/// One struct the host writes and a kernel reads, for the prelude.
#[derive(Debug, Clone, Copy)]
pub struct DeviceStruct {
    pub name: &'static str,
    /// (C type, field name), in order.
    pub fields: &'static [(&'static str, &'static str)],
    /// `size_of` of the Rust struct.
    pub size: usize,
}

impl DeviceStruct {
    /// Its C definition and size check.
    pub fn c_definition(&self) -> String {
        let mut s = format!("struct {} {{\n", self.name);
        for (t, f) in self.fields {
            s.push_str(&format!("    {t} {f};\n"));
        }
        s.push_str(&format!(
            "}};\nstatic_assert(sizeof({}) == {}, \"abi::{} has the size of the host's struct\");\n",
            self.name, self.size, self.name
        ));
        s
    }
}

macro_rules! c_ty {
    (u64 $c:literal) => {
        $c
    };
    ($t:ident) => {
        c_ty!(@ $t)
    };
    (@ f32) => {
        "float"
    };
    (@ i32) => {
        "int"
    };
    (@ u64) => {
        "unsigned long long"
    };
}

macro_rules! device_structs {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident { $($field:ident : $ty:ident $(<$c:literal>)?),* $(,)? }
    )*) => {
        $(
            $(#[doc = $doc])*
            #[repr(C)]
            #[derive(Debug, Clone, Copy, Default, PartialEq)]
            pub struct $name { $(pub $field: $ty),* }
        )*
        /// Every device struct, for the prelude.
        pub const STRUCTS: &[DeviceStruct] = &[$(DeviceStruct {
            name: stringify!($name),
            fields: &[$((c_ty!($ty $($c)?), stringify!($field))),*],
            size: std::mem::size_of::<$name>(),
        }),*];
    };
}

device_structs! {
    /// One layer's weight pointers, `decode_1`'s per-layer table (`lw[LAYERS]`): norms as f32,
    /// matrices as (quant bytes, scales) in the device layouts of `common.cuh`.
    LayerW {
        attn_norm: u64<"const float*">,
        qkv_qs: u64<"const void*">,
        qkv_sc: u64<"const void*">,
        o_qs: u64<"const void*">,
        o_sc: u64<"const void*">,
        ffn_norm: u64<"const float*">,
        gu_qs: u64<"const void*">,
        gu_sc: u64<"const void*">,
        down_qs: u64<"const void*">,
        down_sc: u64<"const void*">,
    }
    /// Per-row parameters of `sample_probs` (temperature <= 0: greedy).
    SampleParams {
        temperature: f32,
        top_p: f32,
        min_p: f32,
        top_k: i32,
        seed: u64,
        draw: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_definitions_follow_the_rust_fields() {
        assert_eq!(std::mem::size_of::<SampleParams>(), 32);
        assert_eq!(std::mem::size_of::<LayerW>(), 80);
        let s = STRUCTS[1].c_definition();
        assert!(
            s.starts_with("struct SampleParams {\n    float temperature;\n"),
            "{s}"
        );
        assert!(
            s.contains(
                "    unsigned long long draw;\n};\nstatic_assert(sizeof(SampleParams) == 32"
            ),
            "{s}"
        );
        assert!(STRUCTS[0]
            .c_definition()
            .contains("    const float* attn_norm;\n"));
    }
}
