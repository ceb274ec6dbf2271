//! The committed reduction kernels (`kernels/reduce.ptx`) are up to date with their source
//! (`kernels/reduce.cu`) and assemble for sm_70, sm_80 and sm_90: `scripts/check-kernels`,
//! which needs python3 with pip, and PyPI the first time only (it caches NVRTC and ptxas);
//! and every kernel in it takes the parameters the launcher passes (read from the PTX alone).

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

/// Every kernel of the committed PTX takes exactly four 64-bit parameters, the one launch
/// contract of `src/device/cuda/kernels.rs` (three pointers or scalars and the count). A
/// kernel given another signature in `kernels/reduce.cu` would still load and launch on a
/// GPU, reading its parameters wrong, and the stand-in driver (which calls host code by name)
/// would not notice either: this reads the signatures from the PTX itself.
#[test]
fn every_kernel_takes_the_four_64_bit_parameters_the_launcher_passes() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/reduce.ptx");
    let ptx = std::fs::read_to_string(&path).expect("kernels/reduce.ptx is committed");
    let mut kernels = 0;
    let mut wrong = Vec::new();
    for (i, _) in ptx.match_indices(".entry ") {
        let rest = &ptx[i + ".entry ".len()..];
        let (name, after) = rest.split_once('(').expect("an entry's parameter list");
        let (list, _) = after.split_once(')').expect("an entry's parameter list ends");
        let params: Vec<&str> = list.split(',').map(str::trim).filter(|p| !p.is_empty()).collect();
        kernels += 1;
        if params.len() != 4 || !params.iter().all(|p| p.starts_with(".param .u64 ")) {
            wrong.push(format!("{name}: {params:?}"));
        }
    }
    assert!(kernels >= 90, "only {kernels} kernels found in {}", path.display());
    assert!(wrong.is_empty(), "kernels not taking four .u64 parameters:\n{}", wrong.join("\n"));
}
