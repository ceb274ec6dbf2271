//! The committed reduction kernels (`kernels/reduce.ptx`) are up to date with their source
//! (`kernels/reduce.cu`) and assemble for sm_70, sm_80 and sm_90: `scripts/check-kernels`,
//! which needs python3 with pip, and PyPI the first time only (it caches NVRTC and ptxas).

use std::path::Path;
use std::process::Command;

#[test]
fn committed_ptx_is_current_and_assembles() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(repo.join("scripts/check-kernels"))
        .current_dir(repo)
        .output()
        .expect("running bash scripts/check-kernels");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    // Shown with --nocapture: what was checked.
    print!("{}", text(&out.stdout));
    assert!(
        out.status.success(),
        "scripts/check-kernels failed ({}):\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}
