//! The library's own vocabulary for what an operation works on: datatypes and reduction
//! operators, as safe Rust enums. The C integers that arrive at the boundary are converted into
//! these once (`abi::types`), so nothing below the boundary ever sees an unchecked value.

/// The 12 NCCL datatypes, with NCCL's numeric values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bfloat16 = 9,
    Float8e4m3 = 10,
    Float8e5m2 = 11,
}

impl DataType {
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8e4m3,
        DataType::Float8e5m2,
    ];

    pub fn from_raw(v: i32) -> Option<DataType> {
        usize::try_from(v).ok().and_then(|i| Self::ALL.get(i).copied())
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 | DataType::Float8e5m2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(
            self,
            DataType::Int8 | DataType::Uint8 | DataType::Int32 | DataType::Uint32 | DataType::Int64 | DataType::Uint64
        )
    }

    /// The name used in logs and error messages (nccl-tests' spelling).
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8e4m3 => "f8e4m3",
            DataType::Float8e5m2 => "f8e5m2",
        }
    }
}

/// A built-in reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BuiltinOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl BuiltinOp {
    pub const ALL: [BuiltinOp; 5] = [BuiltinOp::Sum, BuiltinOp::Prod, BuiltinOp::Max, BuiltinOp::Min, BuiltinOp::Avg];

    pub fn from_raw(v: i32) -> Option<BuiltinOp> {
        usize::try_from(v).ok().and_then(|i| Self::ALL.get(i).copied())
    }

    pub fn name(self) -> &'static str {
        match self {
            BuiltinOp::Sum => "sum",
            BuiltinOp::Prod => "prod",
            BuiltinOp::Max => "max",
            BuiltinOp::Min => "min",
            BuiltinOp::Avg => "avg",
        }
    }
}

/// A scalar for PreMulSum, already read and stored as the bytes of one element of the
/// operator's datatype (little-endian, the datatype's own encoding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scalar {
    pub bytes: [u8; 8],
}

/// The reduction an operation applies, resolved from the C `ncclRedOp_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedOp {
    Builtin(BuiltinOp),
    /// `x * scalar` on every rank's input, then a sum.
    PreMulSum(Scalar),
}

impl RedOp {
    pub fn name(self) -> &'static str {
        match self {
            RedOp::Builtin(b) => b.name(),
            RedOp::PreMulSum(_) => "premulsum",
        }
    }
}
