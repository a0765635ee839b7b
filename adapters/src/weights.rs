//! A checkpoint directory's weights by HF tensor name (one or sharded safetensors files,
//! each header validated before MLX touches the data), and the same with progress
//! reported as tensors are taken, which is how every built-in family loads.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use safetensors::tensor::Metadata;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoadOptions, LoadRequest, Part, WeightSource};

/// Longest header read, as the safetensors format bounds it: a longer one is a corrupt
/// length, not a header to allocate.
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

fn is_float(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float64
    )
}

/// A tensor's entry in a safetensors header.
#[derive(Debug, Clone)]
struct HeaderEntry {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// Byte offset of the tensor's data in its file.
    offset: u64,
}

/// Reads and checks a safetensors header without loading data: every tensor's byte
/// range must lie inside the file and match its dtype and shape. MLX loads lazily and
/// would otherwise fail (or read garbage) only when a truncated tensor is first used.
///
/// The `safetensors` crate parses and validates the header (offsets contiguous, sizes
/// matching dtype and shape). Only the 8-byte length and the header are read here and
/// handed to it: its `read_metadata` wants the whole file in memory, which for a
/// checkpoint of many gigabytes would be all of it read (or mapped) just to check.
fn read_header(path: &Path) -> Result<BTreeMap<String, HeaderEntry>> {
    let corrupt = |reason: String| ModelError::CorruptWeights {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| corrupt("shorter than its 8-byte header length".into()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
        return Err(corrupt(format!(
            "header length {header_len} does not fit in a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| corrupt(format!("header is not a valid safetensors header: {e}")))?;
    let data_len = file_len - 8 - header_len;
    let mut entries = BTreeMap::new();
    for (name, info) in metadata.tensors() {
        let (start, end) = info.data_offsets;
        if end as u64 > data_len {
            return Err(corrupt(format!(
                "tensor `{name}` ends at byte {end} but the file holds {data_len} data bytes (truncated?)"
            )));
        }
        let entry = HeaderEntry {
            dtype: info.dtype,
            shape: info.shape.clone(),
            offset: 8 + header_len + start as u64,
        };
        entries.insert(name, entry);
    }
    Ok(entries)
}

/// The safetensors files of a checkpoint dir: `model.safetensors.index.json`'s shards
/// when present, else every `*.safetensors` file.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let parsed: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::config(&index, format!("invalid JSON: {e}")))?;
        let map = parsed["weight_map"]
            .as_object()
            .ok_or_else(|| ModelError::config(&index, "has no `weight_map` object"))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        for f in &files {
            if !f.is_file() {
                return Err(ModelError::config(
                    &index,
                    format!("lists shard {} which does not exist", f.display()),
                ));
            }
        }
        return Ok(files);
    }
    let listing = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = listing
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::config(
            dir,
            "no *.safetensors weights found; point --target at a model directory (GGUF files must be converted first with `dspec convert`)",
        ));
    }
    Ok(files)
}

/// Loads every tensor of one safetensors file into `tensors` (later files win on a
/// name clash), after checking its header, whose entries go into `layout`.
fn load_file(
    file: &Path,
    tensors: &mut HashMap<String, (PathBuf, Array)>,
    layout: &mut HashMap<String, HeaderEntry>,
) -> Result<()> {
    let header = read_header(file)?;
    let arrays = Array::load_safetensors(file).map_err(|e| ModelError::MlxIo {
        path: file.to_path_buf(),
        message: e.to_string(),
    })?;
    for (name, array) in arrays {
        if let Some(entry) = header.get(&name) {
            let stored: Vec<usize> = array.shape().iter().map(|&d| d as usize).collect();
            if stored != entry.shape {
                return Err(ModelError::CorruptWeights {
                    path: file.to_path_buf(),
                    reason: format!(
                        "tensor `{name}` ({}) read back with a different shape",
                        entry.dtype
                    ),
                });
            }
        }
        if let Some(entry) = header.get(&name) {
            layout.insert(name.clone(), entry.clone());
        }
        tensors.insert(name, (file.to_path_buf(), array));
    }
    Ok(())
}

/// MLX's dtype for a safetensors dtype, for the types read part by part.
fn stored_dtype(dtype: safetensors::Dtype) -> Option<(Dtype, usize)> {
    use safetensors::Dtype as Stored;
    Some(match dtype {
        Stored::F32 => (Dtype::Float32, 4),
        Stored::F16 => (Dtype::Float16, 2),
        Stored::BF16 => (Dtype::Bfloat16, 2),
        Stored::U32 => (Dtype::Uint32, 4),
        Stored::I32 => (Dtype::Int32, 4),
        Stored::U8 => (Dtype::Uint8, 1),
        Stored::I8 => (Dtype::Int8, 1),
        _ => return None,
    })
}

/// Reads `part` of the tensor `entry` describes straight from `file`: one contiguous
/// byte range per index of the axes before `part.axis` (a row block is one read, a
/// column block one read per row). Safetensors stores little-endian data, as every
/// platform dspec runs on does.
fn read_part(
    file: &Path,
    name: &str,
    entry: &HeaderEntry,
    dtype: Dtype,
    elem: usize,
    part: Part,
) -> Result<Array> {
    use std::os::unix::fs::FileExt;
    let shape: Vec<i32> = entry.shape.iter().map(|&d| d as i32).collect();
    let Some(&len) = shape.get(part.axis) else {
        return Err(ModelError::Unsupported(format!(
            "tensor `{name}` of shape {shape:?} has no axis {}",
            part.axis
        )));
    };
    let (start, end) = part.range(name, len)?;
    let outer: usize = shape[..part.axis].iter().map(|&d| d as usize).product();
    let inner: usize = shape[part.axis + 1..].iter().map(|&d| d as usize).product();
    let chunk = (end - start) as usize * inner * elem;
    let total = outer * chunk;
    // u64 words: MLX copies the data element by element, so it must be aligned.
    let mut words = vec![0u64; total.div_ceil(8)];
    // SAFETY: the byte view covers exactly the words' memory, which lives until the
    // array below has copied it.
    let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, total) };
    let handle = File::open(file).map_err(|source| ModelError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    for o in 0..outer {
        let at = entry.offset + ((o * len as usize + start as usize) * inner * elem) as u64;
        handle
            .read_exact_at(&mut bytes[o * chunk..(o + 1) * chunk], at)
            .map_err(|source| ModelError::Io {
                path: file.to_path_buf(),
                source,
            })?;
    }
    let mut local = shape.clone();
    local[part.axis] = end - start;
    // SAFETY: `words` holds `total` bytes, exactly `local`'s elements of `dtype`, which
    // MLX copies before returning.
    Ok(unsafe { Array::from_raw_data(words.as_ptr() as *const _, &local, dtype) })
}

/// Weights of a checkpoint directory, loaded lazily by MLX.
pub struct Weights {
    dir: PathBuf,
    options: LoadOptions,
    /// name -> (file, array)
    tensors: HashMap<String, (PathBuf, Array)>,
    /// name -> where its data lies, for reading parts of it alone.
    layout: HashMap<String, HeaderEntry>,
    taken: usize,
    total: usize,
}

impl Weights {
    pub fn open(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let (mut tensors, mut layout) = (HashMap::new(), HashMap::new());
        for file in checkpoint_files(dir)? {
            load_file(&file, &mut tensors, &mut layout)?;
        }
        Ok(Self::from_tensors(dir, options, tensors, layout))
    }

    /// One safetensors file on its own, e.g. an adapter file in a directory that also
    /// holds training checkpoints, which [`Weights::open`] would mix in.
    pub fn open_file(path: &Path, options: &LoadOptions) -> Result<Self> {
        let (mut tensors, mut layout) = (HashMap::new(), HashMap::new());
        load_file(path, &mut tensors, &mut layout)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Ok(Self::from_tensors(dir, options, tensors, layout))
    }

    fn from_tensors(
        dir: &Path,
        options: &LoadOptions,
        tensors: HashMap<String, (PathBuf, Array)>,
        layout: HashMap<String, HeaderEntry>,
    ) -> Self {
        let total = tensors.len();
        Self {
            dir: dir.to_path_buf(),
            options: options.clone(),
            tensors,
            layout,
            taken: 0,
            total,
        }
    }

    /// Tensors handed out so far (for progress reports).
    pub fn taken(&self) -> usize {
        self.taken
    }

    /// Tensors in the checkpoint.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Names nobody asked for (after loading: tensors the model does not use).
    pub fn unused(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort();
        names
    }

    fn take(&mut self, name: &str, expected: &[i32]) -> Result<(PathBuf, Array)> {
        let found = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
                expected: expected.to_vec(),
            })?;
        self.taken += 1;
        Ok(found)
    }
}

impl Weights {
    /// Checks that `array` (tensor `name` of `file`, or a part of it, whose whole shape
    /// is `stored`) is a float tensor of shape `shape`, and casts it as asked.
    fn checked_float(
        &self,
        name: &str,
        file: PathBuf,
        stored: &[i32],
        shape: &[i32],
        array: Array,
    ) -> Result<Array> {
        if stored != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                file,
                expected: shape.to_vec(),
                actual: stored.to_vec(),
            });
        }
        if !is_float(array.dtype()) {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_string(),
                file,
                dtype: format!("{:?}", array.dtype()),
                wanted: "a float tensor".into(),
            });
        }
        match self.options.dtype {
            Some(dtype) if dtype != array.dtype() => Ok(array.as_dtype(dtype)?),
            _ => Ok(array),
        }
    }

    /// `part` of tensor `name`, read alone from its file when its dtype allows, else
    /// cut from the whole (lazily loaded) tensor; with the tensor's whole shape.
    fn take_part(
        &mut self,
        name: &str,
        expected: &[i32],
        part: Part,
    ) -> Result<(PathBuf, Vec<i32>, Array)> {
        let (file, whole) = self.take(name, expected)?;
        let stored = whole.shape().to_vec();
        let readable = self
            .layout
            .get(name)
            .and_then(|entry| stored_dtype(entry.dtype).map(|(d, elem)| (entry, d, elem)));
        let array = match readable {
            // Dropping `whole` unevaluated means MLX never reads the rest of the tensor.
            Some((entry, dtype, elem)) => read_part(&file, name, entry, dtype, elem, part)?,
            None => part.of(name, &whole)?,
        };
        Ok((file, stored, array))
    }
}

impl WeightSource for Weights {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let (file, array) = self.take(name, shape)?;
        let stored = array.shape().to_vec();
        self.checked_float(name, file, &stored, shape, array)
    }

    fn tensor_part(&mut self, name: &str, shape: &[i32], part: Part) -> Result<Array> {
        let (file, stored, array) = self.take_part(name, shape, part)?;
        self.checked_float(name, file, &stored, shape, array)
    }

    fn raw_part(&mut self, name: &str, part: Part) -> Result<Array> {
        Ok(self.take_part(name, &[], part)?.2)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        Ok(self.take(name, &[])?.1)
    }

    fn options(&self) -> &LoadOptions {
        &self.options
    }
}

/// Forwards to [`Weights`] and reports progress as tensors are taken.
pub(crate) struct ProgressWeights<'a> {
    inner: Weights,
    progress: &'a dyn Fn(usize, usize),
}

impl<'a> ProgressWeights<'a> {
    /// The checkpoint of `req`, reporting to its progress callback.
    pub(crate) fn open(req: &LoadRequest<'a>) -> Result<Self> {
        Ok(Self {
            inner: Weights::open(req.dir, req.options)?,
            progress: req.progress,
        })
    }
}

impl WeightSource for ProgressWeights<'_> {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let t = self.inner.tensor(name, shape)?;
        // MLX reads lazily; evaluating here makes progress reflect the real I/O and
        // frees the checkpoint-dtype copy as soon as a cast tensor exists.
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        let t = self.inner.raw(name)?;
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn tensor_part(&mut self, name: &str, shape: &[i32], part: Part) -> Result<Array> {
        let t = self.inner.tensor_part(name, shape, part)?;
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn raw_part(&mut self, name: &str, part: Part) -> Result<Array> {
        let t = self.inner.raw_part(name, part)?;
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn options(&self) -> &LoadOptions {
        self.inner.options()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{write_random_model, TINY_LLAMA};
    use dspec_plugin_api::Quantization;

    /// A part read alone from the file equals the same part of the whole tensor, for row
    /// and column parts of dense f32 and bf16 tensors, a bias, and packed quantized ones.
    #[test]
    fn parts_read_alone_equal_parts_of_the_whole() {
        let q4 = Quantization {
            bits: 4,
            group_size: 32,
        };
        for (stored, dtype) in [
            (None, None),
            (None, Some(Dtype::Bfloat16)),
            (Some(q4), None),
        ] {
            let dir = tempfile::tempdir().expect("temp dir");
            write_random_model(dir.path(), TINY_LLAMA, 5, stored).expect("fixture");
            if let Some(dtype) = dtype {
                // Store the checkpoint itself in bf16, as most released ones are.
                let file = dir.path().join("model.safetensors");
                let arrays = Array::load_safetensors(&file).expect("load");
                let cast: Vec<(String, Array)> = arrays
                    .into_iter()
                    .map(|(n, a)| (n, a.as_dtype(dtype).expect("cast")))
                    .collect();
                // Beside it first: the loaded arrays still read from the file lazily.
                let tmp = dir.path().join("cast.safetensors.tmp.safetensors");
                Array::save_safetensors(cast.iter().map(|(n, a)| (n.as_str(), a)), None, &tmp)
                    .expect("save");
                std::fs::rename(&tmp, &file).expect("replace");
            }
            let options = LoadOptions::default();
            let mut whole = Weights::open(dir.path(), &options).expect("open");
            let mut parts = Weights::open(dir.path(), &options).expect("open");
            let name = "model.layers.0.self_attn.o_proj.weight";
            for (axis, count) in [(0usize, 2), (1, 2), (0, 4), (1, 4)] {
                for index in 0..count {
                    let part = Part { axis, index, count };
                    let (a, b) = match stored {
                        None => (
                            part.of(name, &whole.tensor(name, &[32, 32]).expect("whole"))
                                .expect("slice"),
                            parts.tensor_part(name, &[32, 32], part).expect("part"),
                        ),
                        Some(_) => (
                            part.of(name, &whole.raw(name).expect("whole"))
                                .expect("slice"),
                            parts.raw_part(name, part).expect("part"),
                        ),
                    };
                    assert_eq!(a.shape(), b.shape(), "{part:?}");
                    assert_eq!(a.dtype(), b.dtype(), "{part:?}");
                    assert!(a.eq_values(&b).expect("compare"), "{part:?}");
                    // Taken tensors are gone from both sources; put them back.
                    whole = Weights::open(dir.path(), &options).expect("open");
                    parts = Weights::open(dir.path(), &options).expect("open");
                }
            }
            let err = parts
                .tensor_part(
                    name,
                    &[32, 32],
                    Part {
                        axis: 0,
                        index: 0,
                        count: 3,
                    },
                )
                .expect_err("32 rows over 3");
            assert!(err.to_string().contains("3 equal parts"), "{err}");
        }
    }

    /// A header is checked before MLX reads any data: a truncated file names the tensor
    /// cut short, a header whose sizes disagree with its shapes or whose length does
    /// not fit the file is reported as corrupt, and a sound file's entries point at
    /// their data.
    #[test]
    fn headers_are_checked_before_any_data_is_read() {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, header: &str, data: usize| {
            let path = dir.path().join(name);
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend(header.as_bytes());
            bytes.resize(bytes.len() + data, 0);
            std::fs::write(&path, bytes).expect("write");
            path
        };
        let header = r#"{"__metadata__":{"format":"mlx"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]}}"#;
        let sound = read_header(&write("sound.safetensors", header, 32)).expect("sound");
        assert_eq!(sound.len(), 2);
        let b = &sound["b"];
        assert_eq!(
            (b.dtype, b.shape.clone()),
            (safetensors::Dtype::BF16, vec![4])
        );
        assert_eq!(b.offset, 8 + header.len() as u64 + 24);

        let cut = read_header(&write("cut.safetensors", header, 30)).expect_err("truncated");
        let cut = cut.to_string();
        assert!(cut.contains("`b`") && cut.contains("truncated"), "{cut}");

        let wrong = header.replace("[2,3]", "[2,4]");
        let err = read_header(&write("sizes.safetensors", &wrong, 32)).expect_err("bad size");
        assert!(matches!(err, ModelError::CorruptWeights { .. }), "{err}");

        let garbage = dir.path().join("garbage.safetensors");
        std::fs::write(&garbage, b"definitely not safetensors").expect("write");
        let err = read_header(&garbage).expect_err("garbage").to_string();
        assert!(
            err.contains("garbage.safetensors") && err.contains("not a valid safetensors"),
            "{err}"
        );
    }
}
