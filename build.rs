//! Gives the shared library NCCL's SONAME, so programs linked against it record `libnccl.so.2`
//! exactly as they would with NVIDIA's library. Nothing is generated at build time.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}
