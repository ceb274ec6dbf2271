//! Command line: nccl-tests' flags, the baselines' iteration scaling and extra sizes, and the
//! tool's own modes (`--json`, `--plot`, `--init`).

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AlltoAll,
    SendRecv,
    Gather,
    Scatter,
}

impl Coll {
    pub fn parse(s: &str) -> Option<Coll> {
        Some(match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
            "allreduce" => Coll::AllReduce,
            "allgather" => Coll::AllGather,
            "reducescatter" => Coll::ReduceScatter,
            "broadcast" | "bcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "alltoall" => Coll::AlltoAll,
            "sendrecv" => Coll::SendRecv,
            "gather" => Coll::Gather,
            "scatter" => Coll::Scatter,
            _ => return None,
        })
    }
    /// The name in the baselines' tables (mpi_allreduce_bench, gloo_bench).
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reducescatter",
            Coll::Broadcast => "bcast",
            Coll::Reduce => "reduce",
            Coll::AlltoAll => "alltoall",
            Coll::SendRecv => "sendrecv",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
        }
    }
    /// nccl-tests' bus bandwidth factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AlltoAll | Coll::Gather | Coll::Scatter => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }
    pub fn rooted(self) -> bool {
        matches!(self, Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter)
    }
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
    }
    /// Per-rank element counts (input, output) for a count argument `c` on `n` ranks.
    pub fn elems(self, c: usize, n: usize) -> (usize, usize) {
        match self {
            Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv => (c, c),
            Coll::AllGather | Coll::Gather => (c, c * n),
            Coll::ReduceScatter | Coll::Scatter => (c * n, c),
            Coll::AlltoAll => (c * n, c * n),
        }
    }
    /// The count argument for `bytes` of the largest per-rank buffer, as nccl-tests sizes it
    /// (sizes that do not divide among the ranks are rounded down).
    pub fn count_arg(self, bytes: usize, es: usize, n: usize) -> usize {
        let count = bytes / es;
        match self {
            Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv => count,
            _ => count / n,
        }
    }
}

/// A datatype: its `ncclDataType_t` value, nccl-tests' name and its size in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dtype {
    pub id: i32,
    pub name: &'static str,
    pub size: usize,
}

/// A reduction: its `ncclRedOp_t` value and name ([`PREMULSUM`]: one each rank creates).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RedOp {
    pub id: i32,
    pub name: &'static str,
}

/// `-o premulsum` (nccl-tests' `mulsum`): each communicator's `ncclRedOpCreatePreMulSum`
/// with the host-immediate scalar 1, so the results are the sum's.
pub const PREMULSUM: i32 = -1;

#[derive(Clone, Debug, PartialEq)]
pub enum Table {
    /// nccl-tests' table: out-of-place and in-place columns.
    NcclTests,
    /// mpi_allreduce_bench's table (out-of-place only), which run_all.sh summarises.
    Baselines,
}

#[derive(Clone, Debug)]
pub enum Mode {
    Bench,
    Plot { out: String, inputs: Vec<String> },
    Init { nranks: usize },
}

#[derive(Clone, Debug)]
pub struct Opts {
    pub mode: Mode,
    pub coll: Coll,
    pub np: usize,
    pub threads: usize,
    pub min: usize,
    pub max: usize,
    pub factor: usize,
    pub incr: usize,
    pub extra: Vec<usize>,
    pub iters: usize,
    /// Some(NMIN): sizes above 1 MiB run max(NMIN, iters * 1MiB / size) iterations.
    pub min_iters: Option<usize>,
    pub warmup: usize,
    pub check: bool,
    pub dtype: Dtype,
    pub op: RedOp,
    pub root: i32,
    pub bind: bool,
    /// Processes split into this many simulated hosts (`--hosts`; 0: as the machine says).
    pub hosts: usize,
    /// CUDA mode: buffers in device memory, each rank on a stream of its own (`--device 1`).
    pub device: bool,
    /// ... of the virtual memory API, as PyTorch's expandable segments allocate it (`--device 2`).
    pub vmm: bool,
    /// ... that cannot be exported, so peers cannot map it (`--device 3`: as a stream-ordered
    /// allocator's pools, PyTorch's cudaMallocAsync backend).
    pub private: bool,
    /// `-G N` (nccl-tests' flag): each rank's call captured into a CUDA graph once per size and
    /// mode, each iteration N launches of it; 0: calls.
    pub graph: usize,
    /// Nonblocking communicators (`--nonblocking 1`, `config.blocking = 0`): a call returning
    /// `ncclInProgress` is waited for by polling `ncclCommGetAsyncError`, as NCCL documents.
    pub nonblocking: bool,
    pub table: Table,
    /// The baselines' table measures the in-place call instead (`--in-place 1`).
    pub in_place: bool,
    pub json: Option<String>,
    pub label: Option<String>,
    pub repeats: usize,
}

pub const USAGE: &str = "usage: nccl-rs-perf [allreduce|allgather|reducescatter|broadcast|reduce|alltoall|sendrecv|gather|scatter] [flags]
       nccl-rs-perf --init N [--repeat R] [--bind 0|1]
       nccl-rs-perf --plot OUT.svg FILE.json|TABLE.txt[#op] ...
nccl-tests' flags:
  -np N   processes (forked here)      -t N   ranks per process (ncclCommInitAll)
  -b SIZE minimum bytes (8)            -e SIZE maximum bytes (32M)
  -f F    multiply size by F (2)       -i N   add N bytes instead of multiplying
  -n N    timed iterations (20)        -w N   warmup iterations (5)
  -c 0|1  check results (1)            -d T   datatype (float): int8 uint8 int32 uint32 int64
  -o OP   sum|prod|max|min|avg (sum)          uint64 half float double bfloat16 f8e4m3 f8e5m2
          premulsum (mulsum): scalar 1     -g N, -z 0|1: accepted (host mode always blocks)
  -r R    root (0)
as the baselines (../shared/scripts/baselines/mpi_allreduce_bench.c):
  -x LIST        extra sizes merged into the sweep (e.g. 64M,256M)
  --min-iters M  sizes over 1 MiB run max(M, N*1MiB/size) iterations, warmup likewise (min 2)
  --bind 0|1     pin process p to the p-th allowed CPU, like mpirun --bind-to core (0)
  --hosts H      split the -np processes into H hosts as NCCL tells them apart (NCCL_HOSTID
                 per process, in consecutive runs): pairs across them go through sockets as
                 between machines (0: the machine's own identity for all)
  --device 0|1|2|3 CUDA mode: buffers on the current device (0), a stream per rank; each timed
                 call ends with cuStreamSynchronize; 2: the buffers in 20 MiB allocations of the
                 virtual memory API, as PyTorch's expandable segments place tensors; 3: the same
                 but not exportable, device memory peers cannot map (as cudaMallocAsync pools)
  -G N           with --device: each rank's call captured into a CUDA graph (once per size and
                 mode), each timed iteration N launches of it, the time shown per launch
                 (nccl-tests' flag; nccl-rs records calls into graphs with NCCL_RS_GRAPH_CAPTURE=1)
  --nonblocking 0|1 communicators made with config.blocking = 0; a call that returns
                 ncclInProgress is waited for by polling ncclCommGetAsyncError (as with
                 NCCL_COMM_BLOCKING=0); the time in the calls is shown below the table
  --table nccl-tests|baselines   output format (nccl-tests); baselines: out-of-place only
  --in-place 0|1 the baselines' table measures the in-place call (0); MPI_Bcast and Gloo's
                 broadcast have one buffer, so their equivalent is an in-place ncclBroadcast
tool modes:
  --json FILE    also write the table and its metadata as JSON   --label TEXT  name in plots
  --plot OUT.svg FILE...   busbw against size (log2), one line per file (a table: per op)
  --init N       fork N processes, time ncclCommInitRank/first call/ncclCommDestroy over
                 --repeat R (10) repeats; memory growth (VmRSS, VmHWM) and ncclCommMemStats
timing: every iteration is barrier; t0; op; t1; the table shows the median over iterations
of the slowest rank's time (nccl-tests itself shows the mean of rank 0's loop).";

pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1usize << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|v| v * mul)
}

fn dtype(s: &str) -> Option<Dtype> {
    let (id, name, size) = match s {
        "int8" | "char" => (0, "int8", 1),
        "uint8" => (1, "uint8", 1),
        "int32" | "int" => (2, "int32", 4),
        "uint32" => (3, "uint32", 4),
        "int64" => (4, "int64", 8),
        "uint64" => (5, "uint64", 8),
        "half" | "float16" => (6, "half", 2),
        "float" | "float32" => (7, "float", 4),
        "double" | "float64" => (8, "double", 8),
        "bfloat16" => (9, "bfloat16", 2),
        "f8e4m3" | "fp8_e4m3" | "float8e4m3" => (10, "f8e4m3", 1),
        "f8e5m2" | "fp8_e5m2" | "float8e5m2" => (11, "f8e5m2", 1),
        _ => return None,
    };
    Some(Dtype { id, name, size })
}

fn redop(s: &str) -> Option<RedOp> {
    let (id, name) = match s {
        "sum" => (0, "sum"),
        "prod" => (1, "prod"),
        "max" => (2, "max"),
        "min" => (3, "min"),
        "avg" => (4, "avg"),
        "premulsum" | "mulsum" => (PREMULSUM, "premulsum"),
        _ => return None,
    };
    Some(RedOp { id, name })
}

fn defaults() -> Opts {
    Opts {
        mode: Mode::Bench,
        coll: Coll::AllReduce,
        np: 1,
        threads: 1,
        min: 8,
        max: 32 << 20,
        factor: 2,
        incr: 0,
        extra: Vec::new(),
        iters: 20,
        min_iters: None,
        warmup: 5,
        check: true,
        dtype: Dtype { id: 7, name: "float", size: 4 },
        op: RedOp { id: 0, name: "sum" },
        root: 0,
        bind: false,
        hosts: 0,
        device: false,
        vmm: false,
        private: false,
        graph: 0,
        nonblocking: false,
        table: Table::NcclTests,
        in_place: false,
        json: None,
        label: None,
        repeats: 10,
    }
}

pub fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut o = defaults();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if let Some(c) = Coll::parse(a) {
            o.coll = c;
            i += 1;
            continue;
        }
        if a == "--plot" {
            let rest = &args[i + 1..];
            if rest.len() < 2 {
                return Err(format!("--plot needs OUT.svg and at least one input\n{USAGE}"));
            }
            o.mode = Mode::Plot { out: rest[0].clone(), inputs: rest[1..].to_vec() };
            return Ok(o);
        }
        let v = args.get(i + 1).ok_or_else(|| format!("{a} needs a value\n{USAGE}"))?;
        let bad = || format!("bad value '{v}' for {a}\n{USAGE}");
        let num = || v.parse::<usize>().map_err(|_| bad());
        match a {
            "-np" => o.np = num()?.max(1),
            "-t" => o.threads = num()?.max(1),
            "-g" | "-z" => {}
            "-b" => o.min = parse_size(v).ok_or_else(bad)?,
            "-e" => o.max = parse_size(v).ok_or_else(bad)?,
            "-f" => o.factor = num()?.max(1),
            "-i" => o.incr = parse_size(v).ok_or_else(bad)?,
            "-x" => o.extra = v.split(',').filter(|t| !t.trim().is_empty())
                .map(|t| parse_size(t).ok_or_else(bad)).collect::<Result<_, _>>()?,
            "-n" => o.iters = num()?.max(1),
            "--min-iters" => o.min_iters = Some(num()?.max(1)),
            "-w" => o.warmup = num()?,
            "-c" => o.check = num()? != 0,
            "-d" => o.dtype = dtype(v).ok_or_else(bad)?,
            "-o" => o.op = redop(v).ok_or_else(bad)?,
            "-r" => o.root = v.parse().map_err(|_| bad())?,
            "--bind" => o.bind = num()? != 0,
            "--hosts" => o.hosts = num()?,
            "--device" => {
                let d = num()?;
                if d > 3 {
                    return Err(bad());
                }
                (o.device, o.vmm, o.private) = (d != 0, d >= 2, d == 3);
            }
            "-G" => o.graph = num()?,
            "--nonblocking" => o.nonblocking = num()? != 0,
            "--table" => o.table = match v.as_str() {
                "nccl-tests" => Table::NcclTests,
                "baselines" => Table::Baselines,
                _ => return Err(bad()),
            },
            "--in-place" => o.in_place = num()? != 0,
            "--json" => o.json = Some(v.clone()),
            "--label" => o.label = Some(v.clone()),
            "--init" => o.mode = Mode::Init { nranks: num()?.max(1) },
            "--repeat" => o.repeats = num()?.max(1),
            _ => return Err(format!("unknown option {a}\n{USAGE}")),
        }
        i += 2;
    }
    if o.min > o.max {
        return Err(format!("-b {} is larger than -e {}", o.min, o.max));
    }
    if o.graph > 0 && !o.device {
        return Err(format!("-G {} captures calls on device buffers: it needs --device 1, 2 or 3", o.graph));
    }
    Ok(o)
}

impl Opts {
    /// The sweep (geometric or arithmetic) with the `-x` sizes merged in, sorted, deduplicated.
    pub fn sizes(&self) -> Vec<usize> {
        let mut v = Vec::new();
        let mut size = self.min;
        loop {
            v.push(size);
            let next = if self.incr > 0 { size + self.incr } else { size.saturating_mul(self.factor) };
            if next > self.max || next == size {
                break;
            }
            size = next;
        }
        v.extend(self.extra.iter().copied().filter(|&s| s >= self.min && s <= self.max));
        v.sort_unstable();
        v.dedup();
        v
    }

    /// (timed, warmup) iterations at `bytes`: fixed as in nccl-tests, or scaled down above
    /// 1 MiB as mpi_allreduce_bench does when `--min-iters` is given.
    pub fn iters_at(&self, bytes: usize) -> (usize, usize) {
        match self.min_iters {
            None => (self.iters, self.warmup),
            Some(nmin) => {
                let scale = (1usize << 20) as f64 / bytes.max(1) as f64;
                if scale >= 1.0 {
                    (self.iters.max(nmin), self.warmup.max(2))
                } else {
                    (((self.iters as f64 * scale) as usize).max(nmin), ((self.warmup as f64 * scale) as usize).max(2))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(s: &str) -> Opts {
        parse_args(&s.split_whitespace().map(String::from).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn sweep_merges_extra_sizes_like_the_baselines() {
        let o = opts("allreduce -b 8 -e 256M -f 4 -x 64M,256M");
        let s = o.sizes();
        assert_eq!(s.first(), Some(&8));
        assert!(s.contains(&(128 << 20)) && s.contains(&(64 << 20)) && s.contains(&(256 << 20)));
        assert_eq!(s.len(), 15); // 8 * 4^k up to 128M (13 sizes), then 64M and 256M
    }

    #[test]
    fn iteration_scaling_matches_mpi_allreduce_bench() {
        let o = opts("-n 200 --min-iters 10 -w 10");
        assert_eq!(o.iters_at(8), (200, 10));
        assert_eq!(o.iters_at(1 << 20), (200, 10));
        assert_eq!(o.iters_at(4 << 20), (50, 2));
        assert_eq!(o.iters_at(64 << 20), (10, 2));
        let fixed = opts("-n 7 -w 3");
        assert_eq!(fixed.iters_at(256 << 20), (7, 3));
    }
}
