//! The drift test: every export's Rust signature, printed in C, must equal its prototype in
//! `include/nccl.h` (as `ffi-tests/prototypes.sh` normalises it), name by name and parameter
//! by parameter. Exports that `nccl.h` does not declare (NVIDIA's device API, declared in its
//! `nccl_device/host.h`) are compared with the prototypes written out below.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use super::ctype::Sig;

/// Prototypes of the device-API exports, from NVIDIA 2.32.3's nccl_device/host.h (the
/// Windows-only Gin outbox/inbox pair included: Linux exports them too).
const DEVICE_API: &[&str] = &[
    "ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t* props)",
    "ncclResult_t ncclDevCommCreate(ncclComm_t comm, const ncclDevCommRequirements_t* reqs, ncclDevComm_t* outDevComm)",
    "ncclResult_t ncclDevCommDestroy(ncclComm_t comm, const ncclDevComm_t* devComm)",
    "ncclResult_t ncclGetLsaMultimemDevicePointer(ncclWindow_t window, size_t offset, void** outPtr)",
    "ncclResult_t ncclGetMultimemDevicePointer(ncclWindow_t window, size_t offset, ncclMultimemHandle_t multimem, void** outPtr)",
    "ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t window, size_t offset, int lsaRank, void** outPtr)",
    "ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t window, size_t offset, int peer, void** outPtr)",
    "ncclResult_t ncclGetMultimemDeviceLeInfo(ncclWindow_t window, size_t offset, ncclCftLeId* leId, size_t* leOffset)",
    "ncclResult_t ncclGetCftDeviceLeInfo(ncclWindow_t window, size_t offset, int peerCft, ncclTeam_t cftTeam, ncclCftLeId* leId, size_t* leOffset)",
    "ncclResult_t ncclGetPeerDeviceLeInfo(ncclWindow_t window, size_t offset, int peerWorld, ncclCftLeId* leId, size_t* leOffset)",
    "ncclTeam_t ncclTeamWorld(ncclComm_t comm)",
    "ncclTeam_t ncclTeamLsa(ncclComm_t comm)",
    "ncclTeam_t ncclTeamCft(ncclComm_t comm, ncclCftTeamMode_t mode)",
    "ncclTeam_t ncclTeamCftMultimem(ncclComm_t comm)",
    "int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank)",
    "int ncclTeamRankToLsa(ncclComm_t comm, ncclTeam_t team, int rank)",
    "ncclTeam_t ncclTeamRail(ncclComm_t comm)",
    "ncclResult_t ncclLsaBarrierCreateRequirement(ncclTeam_t team, int nBarriers, ncclLsaBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq)",
    "ncclResult_t ncclGinBarrierCreateRequirement(ncclComm_t comm, ncclTeam_t team, int nBarriers, ncclGinBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq)",
    "int ncclLLA2ACalcSlots(int maxElts, int maxEltSize)",
    "ncclResult_t ncclLLA2ACreateRequirement(int nBlocks, int nSlots, ncclLLA2AHandle_t* outHandle, ncclDevResourceRequirements_t* outReq)",
    "ncclResult_t ncclGinOutboxCreateRequirement(int nBlocks, int size_log2, ncclGinOutboxHandle* outHandle, ncclDevResourceRequirements_t* outReq)",
    "ncclResult_t ncclGinInboxA2ACreateRequirement(ncclTeam_t peers, int nBlocks, int size_log2, ncclGinInboxA2AHandle* outHandle, ncclDevResourceRequirements_t* outReq)",
];

fn line(name: &str, s: &Sig) -> String {
    let args: Vec<String> = s.args.iter().map(|(n, t)| format!("{t} {n}")).collect();
    format!("{} {}({})", s.ret, name, args.join(", "))
}

/// ABI-neutral spelling differences: `(void)` vs `()`, and top-level `const` on a by-value
/// handle (`const ncclComm_t comm`).
fn normalise(l: &str) -> String {
    l.replace("(void)", "()").replace("const ncclComm_t ", "ncclComm_t ")
}

#[test]
fn exports_match_the_header_and_device_api() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("ffi-tests/prototypes.sh"))
        .arg(root.join("include/nccl.h"))
        .output()
        .expect("run prototypes.sh");
    assert!(out.status.success(), "prototypes.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    let header: BTreeSet<String> = String::from_utf8_lossy(&out.stdout).lines().map(normalise).collect();
    let mut expected = header.clone();
    for d in DEVICE_API {
        expected.insert(normalise(d));
        expected.insert(normalise(&d.replacen(" nccl", " pnccl", 1)));
    }
    let mut ours = BTreeSet::new();
    for s in super::all_signatures() {
        ours.insert(normalise(&line(s.name, &s)));
        ours.insert(normalise(&line(&format!("p{}", s.name), &s)));
    }
    // ncclResetDebugInitInternal has no alias and no prototype anywhere public.
    let missing: Vec<_> = expected.difference(&ours).collect();
    let extra: Vec<_> = ours.difference(&expected).collect();
    assert!(missing.is_empty() && extra.is_empty(),
            "signature drift\n  in the headers but not exported so:\n    {}\n  exported but not so in the headers:\n    {}",
            missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n    "),
            extra.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n    "));
    assert!(header.len() >= 146, "the header lost prototypes: {}", header.len());
}
