//! The reduction kernels of CUDA mode (kernels/README.md): the committed PTX, loaded with
//! `cuModuleLoadData` into a context, and launched on a stream. They compute what
//! `device::host::reduce` computes, bit for bit.

use std::ffi::{c_uint, c_void, CString};

use cudarc::driver::sys::{self, CUdevice, CUdevice_attribute, CUfunction, CUjit_option, CUmodule};

use super::stream::Stream;
use super::{check, driver};
use crate::device::host::{ElemOp, Region};
use crate::error::{Error, Result};
use crate::types::{DataType, Scalar};

/// kernels/reduce.ptx, NUL-terminated as `cuModuleLoadData` wants PTX text.
static PTX: &str = concat!(include_str!("../../../kernels/reduce.ptx"), "\0");

/// The operators' kernel names (`BuiltinOp::name()`), in the order of [`op_index`].
const OP_NAMES: [&str; 4] = ["sum", "prod", "max", "min"];

fn op_index(op: ElemOp) -> usize {
    match op {
        ElemOp::Sum => 0,
        ElemOp::Prod => 1,
        ElemOp::Max => 2,
        ElemOp::Min => 3,
    }
}

/// The targets a PTX of ISA 8.0 may name, newest first, for [`load_module`]'s second try.
const RETARGETS: [(i32, &str); 3] = [(90, "sm_90"), (80, "sm_80"), (75, "sm_75")];

/// The module of kernels/reduce.ptx in the current context. Its `.target` is sm_70, the oldest
/// GPU generation we support, so one text runs everywhere: PTX is compiled at load time for
/// the GPU at hand. A driver whose compiler no longer takes that target (CUDA 13's toolkit
/// compilers dropped Volta) gets a second try with the same text naming the newest target of
/// [`RETARGETS`] that device `dev` runs; the kernels use nothing newer than sm_70's features.
/// A failure says what the driver's compiler logged.
fn load_module(dev: CUdevice) -> Result<CUmodule> {
    let first = match load_ptx(PTX) {
        Ok(m) => return Ok(m),
        Err(e) => e,
    };
    let cc = compute_capability(dev)?;
    let Some(&(_, target)) = RETARGETS.iter().find(|(t, _)| *t <= cc) else { return Err(first) };
    let text = retarget(PTX, target).ok_or_else(|| Error::internal("kernels/reduce.ptx names no .target"))?;
    match load_ptx(&text) {
        Ok(m) => {
            crate::info!(INIT, "the reduction kernels did not load as compiled for sm_70 ({}); they did for {target} \
                                (this GPU: compute capability {}.{})", first.msg, cc / 10, cc % 10);
            Ok(m)
        }
        Err(again) => Err(Error::new(again.code, format!("{}; for {target}: {}", first.msg, again.msg))),
    }
}

/// `ptx` (NUL-terminated) with its `.target` line naming `target` instead.
fn retarget(ptx: &str, target: &str) -> Option<String> {
    let start = ptx.find("\n.target ")? + 1;
    let end = start + ptx[start..].find('\n')?;
    Some(format!("{}.target {target}{}", &ptx[..start], &ptx[end..]))
}

/// The compute capability of `dev`, as major * 10 + minor.
fn compute_capability(dev: CUdevice) -> Result<i32> {
    let get = |attr: CUdevice_attribute| -> Result<i32> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer; `dev` came from cuDeviceGet.
        check(format_args!("cuDeviceGetAttribute({attr:?})"), unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
        Ok(v)
    };
    Ok(get(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? * 10
        + get(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?)
}

/// Loads NUL-terminated PTX text into the current context; a failure carries the first lines
/// of the compiler's error log.
fn load_ptx(ptx: &str) -> Result<CUmodule> {
    let mut module: CUmodule = std::ptr::null_mut();
    let mut log = vec![0u8; 4096];
    let mut options = [CUjit_option::CU_JIT_ERROR_LOG_BUFFER, CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    // The driver reads the size from the pointer's value, as its documentation says.
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    // SAFETY: `ptx` is NUL-terminated text; `module` is a valid out-pointer; the two options'
    // values are a buffer of `log.len()` bytes, which outlives the call, and that size.
    let r = unsafe {
        sys::cuModuleLoadDataEx(&mut module, ptx.as_ptr().cast(), options.len() as c_uint, options.as_mut_ptr(),
                                values.as_mut_ptr())
    };
    check("cuModuleLoadDataEx(kernels/reduce.ptx)", r).map_err(|e| {
        let text = String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(log.len())]).into_owned();
        let said: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).take(3).collect();
        if said.is_empty() { e } else { Error::new(e.code, format!("{}: {}", e.msg, said.join(" / "))) }
    })?;
    Ok(module)
}

/// Threads per block, and elements each thread handles before the grid stops growing.
const THREADS: usize = 256;
const ELEMS_PER_THREAD: usize = 8;
const MAX_BLOCKS: usize = 1024;

/// The 72 reduction kernels of one context, indexed by datatype (its NCCL value) and
/// operator, and the stream gate.
pub struct Kernels {
    reduce: [[CUfunction; 4]; 12],
    premul: [CUfunction; 12],
    premul_at: [CUfunction; 12],
    divide: [CUfunction; 12],
    wait_geq: CUfunction,
    indirect: [CUfunction; 12],
    indirect_copy: CUfunction,
}

// SAFETY: CUfunction handles are usable from any thread; the module is never unloaded (it
// lives as long as the primary context that holds it, i.e. the process).
unsafe impl Send for Kernels {}
// SAFETY: as for Send.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the module into the current context (of device `dev`) and looks up every kernel.
    pub(super) fn load(dev: CUdevice) -> Result<Kernels> {
        driver("cuModuleLoadData", || {
            let module = load_module(dev)?;
            let get = |name: String| -> Result<CUfunction> {
                let c = CString::new(name.as_str()).map_err(|_| Error::internal("kernel name with NUL"))?;
                let mut f: CUfunction = std::ptr::null_mut();
                // SAFETY: `module` is loaded; `c` is a NUL-terminated name; `f` a valid out-pointer.
                check(format_args!("cuModuleGetFunction({name})"), unsafe {
                    sys::cuModuleGetFunction(&mut f, module, c.as_ptr())
                })?;
                Ok(f)
            };
            let mut k = Kernels {
                reduce: [[std::ptr::null_mut(); 4]; 12],
                premul: [std::ptr::null_mut(); 12],
                premul_at: [std::ptr::null_mut(); 12],
                divide: [std::ptr::null_mut(); 12],
                wait_geq: get("nccl_rs_wait_geq".to_string())?,
                indirect: [std::ptr::null_mut(); 12],
                indirect_copy: get("nccl_rs_indirect_copy".to_string())?,
            };
            for dt in DataType::ALL {
                let t = dt.name();
                for (i, op) in OP_NAMES.iter().enumerate() {
                    k.reduce[dt as usize][i] = get(format!("nccl_rs_reduce_{t}_{op}"))?;
                }
                k.premul[dt as usize] = get(format!("nccl_rs_premul_{t}"))?;
                k.premul_at[dt as usize] = get(format!("nccl_rs_premul_at_{t}"))?;
                k.divide[dt as usize] = get(format!("nccl_rs_divide_{t}"))?;
                k.indirect[dt as usize] = get(format!("nccl_rs_indirect_{t}"))?;
            }
            Ok(k)
        })
    }

    /// dst[i] <- a[i] op b[i] in stream order, over the elements all three regions hold. `dst`
    /// equals `a` and/or `b` or overlaps neither.
    pub fn reduce(&self, dt: DataType, op: ElemOp, dst: Region, a: Region, b: Region, stream: &Stream) -> Result<()> {
        let n = dst.len().min(a.len()).min(b.len()) / dt.size();
        launch(self.reduce[dt as usize][op_index(op)], [dst.addr() as u64, a.addr() as u64, b.addr() as u64], n, stream)
    }

    /// dst[i] <- src[i] * scalar in stream order (PreMulSum). `dst` equals `src` or is disjoint.
    pub fn premul(&self, dt: DataType, dst: Region, src: Region, scalar: Scalar, stream: &Stream) -> Result<()> {
        let n = dst.len().min(src.len()) / dt.size();
        let s = u64::from_le_bytes(scalar.bytes);
        launch(self.premul[dt as usize], [dst.addr() as u64, src.addr() as u64, s], n, stream)
    }

    /// dst[i] <- src[i] * the element at `scalar` (device memory, read when the kernel runs),
    /// in stream order (PreMulSum with ncclScalarDevice). `dst` equals `src` or is disjoint.
    pub fn premul_at(&self, dt: DataType, dst: Region, src: Region, scalar: Region, stream: &Stream) -> Result<()> {
        let n = dst.len().min(src.len()) / dt.size();
        launch(self.premul_at[dt as usize], [dst.addr() as u64, src.addr() as u64, scalar.addr() as u64], n, stream)
    }

    /// dst[i] <- src[i] / divisor in stream order (ncclAvg; 0 is taken as 1). `dst` equals
    /// `src` or is disjoint.
    pub fn divide(&self, dt: DataType, dst: Region, src: Region, divisor: u64, stream: &Stream) -> Result<()> {
        let n = dst.len().min(src.len()) / dt.size();
        launch(self.divide[dt as usize], [dst.addr() as u64, src.addr() as u64, divisor], n, stream)
    }
}

impl Kernels {
    /// Holds `stream` until word `word` of `mem` reaches `value` (wrapping comparison), with a
    /// one-thread kernel: unlike `cuStreamWaitValue32`, it stalls no hardware queue that other
    /// streams share. `mem` must stay alive until the stream has passed the kernel.
    pub fn wait_geq(&self, stream: &Stream, mem: &super::MappedHost, word: usize, value: u32) -> Result<()> {
        let addr = super::stream::word_addr(mem, word)?;
        launch(self.wait_geq, [addr, 0, value as u64], 1, stream)
    }
}

impl Kernels {
    /// Queues the `kind` kernel that does what the `rows` consecutive 64-byte descriptors from
    /// device address `descs` say when it runs (kernels/reduce.cu, [`Desc`]), side by side;
    /// `n` (elements, or bytes of a copy: the largest) sizes its grid. The descriptors must
    /// stay valid until the stream has passed the kernel.
    pub fn indirect(&self, stream: &Stream, descs: usize, n: usize, kind: Indirect, rows: usize) -> Result<()> {
        let f = match kind {
            Indirect::Copy => self.indirect_copy,
            Indirect::Of(dt) => self.indirect[dt as usize],
        };
        launch_rows(f, [descs as u64, 0, rows as u64], n, rows, stream)
    }
}

/// Which indirect kernel runs a descriptor: the copy kernel, or a datatype's (its reductions
/// and division). Either does nothing with [`Desc::Skip`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Indirect {
    Copy,
    Of(DataType),
}

/// What an `nccl_rs_indirect_*` kernel does (kernels/reduce.cu): nothing, a byte copy, an element-wise
/// reduction or an Avg division.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Desc {
    Skip,
    Copy { dst: usize, src: usize, bytes: usize },
    Reduce { dt: DataType, op: ElemOp, dst: usize, a: usize, b: usize, n: usize },
    Divide { dt: DataType, dst: usize, src: usize, divisor: u64, n: usize },
}

impl Desc {
    /// The kernel that runs it (None: any does, as nothing).
    pub fn kernel(&self) -> Option<Indirect> {
        match *self {
            Desc::Skip => None,
            Desc::Copy { .. } => Some(Indirect::Copy),
            Desc::Reduce { dt, .. } | Desc::Divide { dt, .. } => Some(Indirect::Of(dt)),
        }
    }

    /// The descriptor as the kernel reads it: eight little-endian 64-bit words, as sixteen
    /// 32-bit ones (low half first).
    pub fn words(&self) -> [u32; 16] {
        let q: [u64; 6] = match *self {
            Desc::Skip => [0; 6],
            Desc::Copy { dst, src, bytes } => [1, dst as u64, src as u64, 0, bytes as u64, 0],
            Desc::Reduce { dt, op, dst, a, b, n } => {
                [(2 + op_index(op) as u64) | (dt as u64) << 32, dst as u64, a as u64, b as u64, n as u64, 0]
            }
            Desc::Divide { dt, dst, src, divisor, n } => [6 | (dt as u64) << 32, dst as u64, src as u64, 0, n as u64, divisor],
        };
        let mut w = [0u32; 16];
        for (i, v) in q.iter().enumerate() {
            w[2 * i] = *v as u32;
            w[2 * i + 1] = (*v >> 32) as u32;
        }
        w
    }
}

/// Launches `f(args[0], args[1], args[2], n)`: every kernel takes three 64-bit values (pointers
/// or a scalar) and the element count. Grid-stride kernels, so any grid covers any n.
fn launch(f: CUfunction, args: [u64; 3], n: usize, stream: &Stream) -> Result<()> {
    launch_rows(f, args, n, 1, stream)
}

/// [`launch`] with `rows` rows of blocks (gridDim.y), for kernels that take one descriptor per
/// row.
fn launch_rows(f: CUfunction, args: [u64; 3], n: usize, rows: usize, stream: &Stream) -> Result<()> {
    if n == 0 || rows == 0 {
        return Ok(());
    }
    let rows = c_uint::try_from(rows).map_err(|_| Error::internal(format!("{rows} rows of blocks")))?;
    let blocks = n.div_ceil(THREADS * ELEMS_PER_THREAD).clamp(1, MAX_BLOCKS);
    let [mut x, mut y, mut z] = args;
    let mut count = n as u64;
    let mut params: [*mut c_void; 4] = [
        (&mut x as *mut u64).cast(),
        (&mut y as *mut u64).cast(),
        (&mut z as *mut u64).cast(),
        (&mut count as *mut u64).cast(),
    ];
    driver("cuLaunchKernel", || {
        // SAFETY: `f` is a kernel of the loaded module taking four 8-byte parameters, each
        // pointed to by `params` (read by the driver during the call). The pointers name regions
        // valid for n elements until the stream passes the kernel (the Region contract).
        check(format_args!("cuLaunchKernel({blocks} blocks, n {n})"), unsafe {
            sys::cuLaunchKernel(
                f,
                blocks as c_uint,
                rows,
                1,
                THREADS as c_uint,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The second try's text differs from the committed PTX in its target line only, and stays
    /// NUL-terminated.
    #[test]
    fn retargeted_ptx_names_the_new_target_only() {
        let text = retarget(PTX, "sm_90").expect("kernels/reduce.ptx names a .target");
        assert!(PTX.contains("\n.target sm_70\n"), "the committed PTX's target changed: update RETARGETS");
        assert!(text.contains("\n.target sm_90\n") && !text.contains(".target sm_70"));
        assert_eq!(text.replace("\n.target sm_90\n", "\n.target sm_70\n"), PTX);
        assert!(text.ends_with('\0'));
        assert_eq!(retarget("no target here\n\0", "sm_90"), None);
    }
}
