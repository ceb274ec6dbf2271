//! NVLink topology from NVML (`libnvidia-ml.so.1`, the driver's management library, loaded at
//! run time and never linked, as NCCL does): which GPUs a GPU's active NVLinks reach, and
//! whether they reach an NVSwitch (through which every GPU on the switches is one hop away).
//! Where NVML does not load or cannot say, a GPU has no NVLinks: its distance to other GPUs is
//! what their PCI paths say (`bootstrap::topo`).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

/// A GPU's active NVLinks: the PCI bus ids of the GPUs they reach (lower case, four-digit
/// domain, as `cuDeviceGetPCIBusId` gives them: `0000:3b:00.0`), and whether some reach an
/// NVSwitch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvLinks {
    pub gpus: Vec<String>,
    pub switch: bool,
    /// Active links.
    pub active: u32,
}

type Device = *mut c_void;

/// nvmlPciInfo_t (NVML's layout, unchanged since its v2 API).
#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

const NVML_SUCCESS: c_int = 0;
/// NVML_NVLINK_MAX_LINKS of current headers (H100 and later have 18).
const MAX_LINKS: c_uint = 18;
const NVML_FEATURE_ENABLED: c_uint = 1;
/// nvmlIntNvLinkDeviceType_t.
const NVLINK_DEVICE_TYPE_GPU: c_uint = 0;
const NVLINK_DEVICE_TYPE_SWITCH: c_uint = 2;

struct Nvml {
    handle_by_bus_id: unsafe extern "C" fn(*const c_char, *mut Device) -> c_int,
    link_state: unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_int,
    remote_pci: unsafe extern "C" fn(Device, c_uint, *mut PciInfo) -> c_int,
    /// Absent from drivers before R460: then the remote's PCI class in sysfs says.
    remote_type: Option<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_int>,
}

/// NVML loaded and initialised once per process, or why not.
fn nvml() -> Result<&'static Nvml, String> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Nvml, String> {
    let name = c"libnvidia-ml.so.1";
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life
    // (never dlclosed), so the symbols below stay valid.
    let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        return Err("libnvidia-ml.so.1 did not load".into());
    }
    let sym = |s: &CStr| {
        // SAFETY: `lib` is a live handle and `s` NUL-terminated.
        let p = unsafe { libc::dlsym(lib, s.as_ptr()) };
        if p.is_null() { None } else { Some(p) }
    };
    let need = |s: &CStr| sym(s).ok_or_else(|| format!("NVML has no {}", s.to_string_lossy()));
    let init = need(c"nvmlInit_v2")?;
    let handle_by_bus_id = need(c"nvmlDeviceGetHandleByPciBusId_v2")?;
    let link_state = need(c"nvmlDeviceGetNvLinkState")?;
    let remote_pci = need(c"nvmlDeviceGetNvLinkRemotePciInfo_v2")?;
    let remote_type = sym(c"nvmlDeviceGetNvLinkRemoteDeviceType");
    // SAFETY: each symbol is the NVML function of that name, whose C signature the
    // function-pointer type spells.
    let nvml = unsafe {
        Nvml {
            handle_by_bus_id: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char, *mut Device) -> c_int>(
                handle_by_bus_id),
            link_state: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_int>(link_state),
            remote_pci: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Device, c_uint, *mut PciInfo) -> c_int>(remote_pci),
            remote_type: remote_type.map(|p| {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> c_int>(p)
            }),
        }
    };
    // SAFETY: nvmlInit_v2 takes no arguments.
    let r = unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(init)() };
    if r != NVML_SUCCESS {
        return Err(format!("nvmlInit_v2 failed (NVML error {r})"));
    }
    Ok(nvml)
}

/// A PCI bus id as `cuDeviceGetPCIBusId` writes it: NVML's "00000000:3B:00.0" becomes
/// "0000:3b:00.0".
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(d) => format!("{d:04x}:{rest}"),
            Err(_) => id,
        },
        None => id,
    }
}

/// The active NVLinks of the GPU with PCI bus id `bus`; `sysfs` (`/sys`) tells a remote end's
/// kind where NVML cannot. An error says why NVML could not tell (no NVML, no such device).
pub fn nvlinks(bus: &str, sysfs: &str) -> Result<NvLinks, String> {
    let nvml = nvml()?;
    let id = CString::new(bus).map_err(|_| "a PCI bus id with a NUL".to_string())?;
    let mut dev: Device = std::ptr::null_mut();
    // SAFETY: a NUL-terminated id and a valid out-pointer.
    let r = unsafe { (nvml.handle_by_bus_id)(id.as_ptr(), &mut dev) };
    if r != NVML_SUCCESS {
        return Err(format!("NVML knows no device {bus} (NVML error {r})"));
    }
    let mut out = NvLinks::default();
    for link in 0..MAX_LINKS {
        let mut state: c_uint = 0;
        // SAFETY: `dev` is NVML's handle; a valid out-pointer. Links past the device's last
        // answer an error, which ends nothing: links need not be numbered densely.
        if unsafe { (nvml.link_state)(dev, link, &mut state) } != NVML_SUCCESS || state != NVML_FEATURE_ENABLED {
            continue;
        }
        // SAFETY: PciInfo is plain data; all zeroes is a valid value.
        let mut pci: PciInfo = unsafe { std::mem::zeroed() };
        // SAFETY: as above; NVML fills `pci`.
        if unsafe { (nvml.remote_pci)(dev, link, &mut pci) } != NVML_SUCCESS {
            continue;
        }
        out.active += 1;
        pci.bus_id[31] = 0;
        // SAFETY: `bus_id` is NUL-terminated within its 32 bytes: its last byte was just zeroed.
        let remote = normalize_bus_id(&unsafe { CStr::from_ptr(pci.bus_id.as_ptr()) }.to_string_lossy());
        let mut kind = c_uint::MAX;
        if let Some(f) = nvml.remote_type {
            // SAFETY: as above.
            if unsafe { f(dev, link, &mut kind) } != NVML_SUCCESS {
                kind = c_uint::MAX;
            }
        }
        if kind == c_uint::MAX {
            // NVSwitches are PCI "other bridge" devices (class 0x0680xx); a GPU is a display
            // controller (0x03xxxx).
            let class = std::fs::read_to_string(format!("{sysfs}/bus/pci/devices/{remote}/class")).unwrap_or_default();
            kind = if class.trim().starts_with("0x0680") { NVLINK_DEVICE_TYPE_SWITCH } else { NVLINK_DEVICE_TYPE_GPU };
        }
        match kind {
            NVLINK_DEVICE_TYPE_SWITCH => out.switch = true,
            NVLINK_DEVICE_TYPE_GPU if !out.gpus.contains(&remote) => out.gpus.push(remote),
            _ => {} // an IBM NPU (a link to the CPU) or unknown
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_written_as_cuda_writes_them() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id(" 00000001:C1:00.0\n"), "0001:c1:00.0");
        assert_eq!(normalize_bus_id("nonsense"), "nonsense");
    }
}
