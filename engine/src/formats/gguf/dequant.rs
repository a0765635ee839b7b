//! Block dequantizers for the ggml tensor types: raw GGUF tensor bytes to f32, one whole
//! block at a time, in the element order ggml itself uses (ne[0] fastest).

use super::GgmlType;
use half::{bf16, f16};

/// Elements in a k-quant super-block (ggml's `QK_K`).
const QK_K: usize = 256;

/// Below this many elements a tensor is decoded on the calling thread; spawning costs more.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 20;

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("no dequantizer for ggml type {0}; supported: {supported}", supported = supported_list())]
    Unsupported(GgmlType),
    #[error(
        "{ty}: {elements} elements need {expected} bytes (blocks of {block} elements), got {got}"
    )]
    SizeMismatch {
        ty: GgmlType,
        elements: usize,
        block: usize,
        expected: usize,
        got: usize,
    },
}

/// A decoder for a run of whole blocks: `data` holds n blocks, `out` their n·block elements.
type Kernel = fn(&[u8], &mut [f32]);

fn kernel_for(ty: GgmlType) -> Option<Kernel> {
    Some(match ty {
        GgmlType::F32 => decode_f32,
        GgmlType::F16 => decode_f16,
        GgmlType::BF16 => decode_bf16,
        GgmlType::Q4_0 => decode_q4_0,
        GgmlType::Q4_1 => decode_q4_1,
        GgmlType::Q5_0 => decode_q5_0,
        GgmlType::Q5_1 => decode_q5_1,
        GgmlType::Q8_0 => decode_q8_0,
        GgmlType::Q8_1 => decode_q8_1,
        GgmlType::Q2_K => decode_q2_k,
        GgmlType::Q3_K => decode_q3_k,
        GgmlType::Q4_K => decode_q4_k,
        GgmlType::Q5_K => decode_q5_k,
        GgmlType::Q6_K => decode_q6_k,
        GgmlType::Q8_K => decode_q8_k,
        _ => return None,
    })
}

/// Whether [`dequantize`] can decode this type.
pub fn is_supported(ty: GgmlType) -> bool {
    kernel_for(ty).is_some()
}

/// The types [`dequantize`] decodes, in ggml id order.
pub fn supported_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| is_supported(t))
        .collect()
}

/// Comma-separated names of the supported types, for error messages.
pub fn supported_list() -> String {
    supported_types()
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Decodes `data` (whole blocks of `ty`) into `out`, whose length is the element count.
///
/// Large tensors are split on block boundaries across the available cores: decoding is
/// memory-bound per block and blocks are independent.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let kernel = kernel_for(ty).ok_or(DequantError::Unsupported(ty))?;
    let block = ty.block_size();
    let bytes = ty.type_size();
    let expected = (out.len() / block).checked_mul(bytes);
    if !out.len().is_multiple_of(block) || expected != Some(data.len()) {
        return Err(DequantError::SizeMismatch {
            ty,
            elements: out.len(),
            block,
            expected: expected.unwrap_or(usize::MAX),
            got: data.len(),
        });
    }
    let n_blocks = out.len() / block;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads <= 1 || out.len() < PARALLEL_MIN_ELEMENTS {
        kernel(data, out);
        return Ok(());
    }
    let blocks_per_thread = n_blocks.div_ceil(threads);
    std::thread::scope(|scope| {
        for (d, o) in data
            .chunks(blocks_per_thread * bytes)
            .zip(out.chunks_mut(blocks_per_thread * block))
        {
            scope.spawn(move || kernel(d, o));
        }
    });
    Ok(())
}

/// Pairs each encoded block with its output elements as fixed-size arrays, so the decoders
/// index with constants and the compiler drops the bounds checks. Callers pass whole blocks
/// (checked in [`dequantize`]), so every chunk converts.
fn blocks<'a, const BYTES: usize, const ELEMS: usize>(
    data: &'a [u8],
    out: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8; BYTES], &'a mut [f32; ELEMS])> {
    data.chunks_exact(BYTES)
        .zip(out.chunks_exact_mut(ELEMS))
        .filter_map(|(b, y)| Some((b.try_into().ok()?, y.try_into().ok()?)))
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn decode_f32(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<4, 1>(data, out) {
        y[0] = f32::from_le_bytes(*b);
    }
}

fn decode_f16(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<2, 1>(data, out) {
        y[0] = f16::from_bits(u16::from_le_bytes(*b)).to_f32();
    }
}

fn decode_bf16(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<2, 1>(data, out) {
        y[0] = bf16::from_bits(u16::from_le_bytes(*b)).to_f32();
    }
}

/// Q4_0: f16 d, 16 bytes of nibbles; low nibbles are elements 0..16, high ones 16..32.
fn decode_q4_0(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<18, 32>(data, out) {
        let d = f16_at(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q4_1: f16 d, f16 m, nibbles as Q4_0; value = q·d + m.
fn decode_q4_1(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<20, 32>(data, out) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20];
        for j in 0..16 {
            y[j] = (qs[j] & 0x0F) as f32 * d + m;
            y[j + 16] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// Q5_0: f16 d, u32 qh (bit j is the 5th bit of element j), nibbles as Q4_0; value = (q − 16)·d.
fn decode_q5_0(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<22, 32>(data, out) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let lo = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
            let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            y[j] = (lo as i32 - 16) as f32 * d;
            y[j + 16] = (hi as i32 - 16) as f32 * d;
        }
    }
}

/// Q5_1: f16 d, f16 m, u32 qh, nibbles; value = q·d + m.
fn decode_q5_1(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<24, 32>(data, out) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..16 {
            let lo = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
            let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            y[j] = lo as f32 * d + m;
            y[j + 16] = hi as f32 * d + m;
        }
    }
}

/// Q8_0: f16 d, 32 × i8.
fn decode_q8_0(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<34, 32>(data, out) {
        let d = f16_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
            *yj = q as i8 as f32 * d;
        }
    }
}

/// Q8_1: f16 d, f16 s (the block sum, only used by dot products), 32 × i8.
fn decode_q8_1(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<36, 32>(data, out) {
        let d = f16_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[4..36]) {
            *yj = q as i8 as f32 * d;
        }
    }
}

/// Q8_K: f32 d, 256 × i8, then 16 × i16 partial sums that only dot products use.
fn decode_q8_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<292, QK_K>(data, out) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (yj, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
            *yj = q as i8 as f32 * d;
        }
    }
}

/// Q2_K: 16 bytes of (scale | min << 4) for 16 sub-blocks of 16, 64 bytes of 2-bit quants,
/// f16 d, f16 dmin. Each 128-element half reads 32 quant bytes four times, two bits deeper
/// each time: element 128h + 32s + 16t + l is bits 2s.. of byte 32h + 16t + l.
fn decode_q2_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<84, QK_K>(data, out) {
        let scales = &b[0..16];
        let qs = &b[16..80];
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for h in 0..2 {
            for s in 0..4 {
                for t in 0..2 {
                    let sub = 8 * h + 2 * s + t;
                    let dl = d * (scales[sub] & 0x0F) as f32;
                    let ml = dmin * (scales[sub] >> 4) as f32;
                    let q = &qs[32 * h + 16 * t..32 * h + 16 * t + 16];
                    let y = &mut y[16 * sub..16 * sub + 16];
                    for l in 0..16 {
                        y[l] = dl * ((q[l] >> (2 * s)) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

/// Q3_K: 32 bytes hmask (bit k of byte i is the third bit of element 32k + i), 64 bytes
/// of 2-bit quants laid out as Q2_K, 12 bytes of 16 six-bit scales (stored +32), f16 d.
/// value = d·(sc − 32)·(q − 4), where a set hmask bit contributes the +4.
fn decode_q3_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<110, QK_K>(data, out) {
        let hmask = &b[0..32];
        let qs = &b[32..96];
        let packed = &b[96..108];
        let d = f16_at(b, 108);
        // Scales 0..8 keep their low 4 bits in the low nibbles of bytes 0..8, scales 8..16 in
        // the high nibbles; the top 2 bits of scale j sit in byte 8 + j%4 at bit 2·(j/4).
        let mut sc = [0f32; 16];
        for (j, scj) in sc.iter_mut().enumerate() {
            let low = if j < 8 {
                packed[j] & 0x0F
            } else {
                packed[j - 8] >> 4
            };
            let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
            *scj = d * ((low | (high << 4)) as i32 - 32) as f32;
        }
        for h in 0..2 {
            for s in 0..4 {
                let bit = 4 * h + s;
                for t in 0..2 {
                    let sub = 8 * h + 2 * s + t;
                    let dl = sc[sub];
                    let q = &qs[32 * h + 16 * t..32 * h + 16 * t + 16];
                    let hm = &hmask[16 * t..16 * t + 16];
                    let y = &mut y[16 * sub..16 * sub + 16];
                    for l in 0..16 {
                        let low = ((q[l] >> (2 * s)) & 3) as i32;
                        let minus = if hm[l] >> bit & 1 != 0 { 0 } else { 4 };
                        y[l] = dl * (low - minus) as f32;
                    }
                }
            }
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K:
/// sub-blocks 0..4 use the low 6 bits of bytes j and j+4; sub-blocks 4..8 take their low
/// 4 bits from the nibbles of byte j+4 and their top 2 bits from the spare bits 6–7 of
/// bytes j−4 (scale) and j (min).
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. Each 64-element
/// chunk c reads 32 bytes: low nibbles are elements 64c..64c+32 (sub-block 2c), high
/// nibbles 64c+32..64c+64 (sub-block 2c+1). value = d·sc·q − dmin·m.
fn decode_q4_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<144, QK_K>(data, out) {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &b[4..16];
        let qs = &b[16..144];
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let q = &qs[32 * c..32 * c + 32];
            let y = &mut y[64 * c..64 * c + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// Q5_K: Q4_K plus 32 bytes qh between the scales and the nibbles: bit 2c of qh[l] is the
/// 5th bit of element 64c + l, bit 2c+1 that of element 64c + 32 + l.
fn decode_q5_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<176, QK_K>(data, out) {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[48..176];
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let q = &qs[32 * c..32 * c + 32];
            let y = &mut y[64 * c..64 * c + 64];
            for l in 0..32 {
                let lo = (q[l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
                let hi = (q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                y[l] = d1 * lo as f32 - m1;
                y[l + 32] = d2 * hi as f32 - m2;
            }
        }
    }
}

/// Q6_K: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 × i8 scales (one per
/// 16 elements), f16 d at the end; value = d·scale·(q − 32). Within each 128-element half,
/// ql byte l holds elements l (low) and l+64 (high), byte l+32 elements l+32 and l+96, and
/// qh byte l holds the high bits of l, l+32, l+64, l+96 at bits 0, 2, 4, 6.
fn decode_q6_k(data: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<210, QK_K>(data, out) {
        let d = f16_at(b, 208);
        let mut sc = [0f32; 16];
        for (scj, &s) in sc.iter_mut().zip(&b[192..208]) {
            *scj = d * s as i8 as f32;
        }
        for h in 0..2 {
            let ql = &b[64 * h..64 * h + 64];
            let qh = &b[128 + 32 * h..128 + 32 * h + 32];
            let sc = &sc[8 * h..8 * h + 8];
            let y = &mut y[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                let q2 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                let q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                let q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                y[l] = sc[is] * (q1 as i32 - 32) as f32;
                y[l + 32] = sc[is + 2] * (q2 as i32 - 32) as f32;
                y[l + 64] = sc[is + 4] * (q3 as i32 - 32) as f32;
                y[l + 96] = sc[is + 6] * (q4 as i32 - 32) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Each test encodes blocks from the format's definition, element by element (the inverse
    //! direction of the decoders, which walk bytes), and compares the decoded values with the
    //! values the definition gives for the chosen quants and scales.
    use super::*;

    /// splitmix64: deterministic test data without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// In lo..=hi, hitting each end a quarter of the time so edge values always occur.
        fn int(&mut self, lo: i32, hi: i32) -> i32 {
            match self.next() % 8 {
                0 => lo,
                1 => hi,
                _ => lo + (self.next() % (hi - lo + 1) as u64) as i32,
            }
        }
        /// An f16-representable scale in ±[0.001, 1), either sign.
        fn f16(&mut self) -> (u16, f32) {
            let mag = 0.001 + (self.next() % 1000) as f32 / 1000.0;
            let v = if self.next().is_multiple_of(2) {
                mag
            } else {
                -mag
            };
            let h = f16::from_f32(v);
            (h.to_bits(), h.to_f32())
        }
    }

    fn put_f16(b: &mut [u8], at: usize, bits: u16) {
        b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }

    /// Encodes `n_blocks` blocks with `encode`, decodes them in one call and compares.
    fn check(ty: GgmlType, n_blocks: usize, encode: fn(&mut Rng, &mut [u8], &mut [f32])) {
        let (bytes, elems) = (ty.type_size(), ty.block_size());
        let mut rng = Rng(ty.id() as u64 * 7919 + n_blocks as u64);
        let mut data = vec![0u8; n_blocks * bytes];
        let mut expected = vec![0f32; n_blocks * elems];
        for (b, e) in data
            .chunks_exact_mut(bytes)
            .zip(expected.chunks_exact_mut(elems))
        {
            encode(&mut rng, b, e);
        }
        let mut got = vec![f32::NAN; n_blocks * elems];
        dequantize(ty, &data, &mut got).expect("dequantize");
        let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * scale,
                "{ty}: element {i} (block {}, index {}) decoded {g}, expected {e}",
                i / elems,
                i % elems
            );
        }
    }

    fn enc_q4_0(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (bits, d) = r.f16();
        put_f16(b, 0, bits);
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, 15);
            // element e: byte e % 16, low nibble for the first 16 elements, high for the rest
            b[2 + e % 16] |= (q as u8) << (4 * (e / 16));
            *o = (q - 8) as f32 * d;
        }
    }

    fn enc_q4_1(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (db, d) = r.f16();
        let (mb, m) = r.f16();
        put_f16(b, 0, db);
        put_f16(b, 2, mb);
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, 15);
            b[4 + e % 16] |= (q as u8) << (4 * (e / 16));
            *o = q as f32 * d + m;
        }
    }

    /// Q5_0 / Q5_1 share the bit layout; `min` is None for Q5_0 (offset −16 instead).
    fn enc_q5(r: &mut Rng, b: &mut [u8], out: &mut [f32], with_min: bool) {
        let (db, d) = r.f16();
        put_f16(b, 0, db);
        let (m, qh_at) = if with_min {
            let (mb, m) = r.f16();
            put_f16(b, 2, mb);
            (m, 4)
        } else {
            (0.0, 2)
        };
        let mut qh = 0u32;
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, 31);
            b[qh_at + 4 + e % 16] |= ((q & 15) as u8) << (4 * (e / 16));
            qh |= ((q >> 4) as u32) << e;
            *o = if with_min {
                q as f32 * d + m
            } else {
                (q - 16) as f32 * d
            };
        }
        b[qh_at..qh_at + 4].copy_from_slice(&qh.to_le_bytes());
    }

    fn enc_q8_0(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (bits, d) = r.f16();
        put_f16(b, 0, bits);
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(-128, 127);
            b[2 + e] = q as i8 as u8;
            *o = q as f32 * d;
        }
    }

    fn enc_q8_1(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (bits, d) = r.f16();
        put_f16(b, 0, bits);
        put_f16(b, 2, r.f16().0); // the sum field must not affect the values
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(-128, 127);
            b[4 + e] = q as i8 as u8;
            *o = q as f32 * d;
        }
    }

    fn enc_q8_k(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let d = r.f16().1 * 0.37;
        b[0..4].copy_from_slice(&d.to_le_bytes());
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(-128, 127);
            b[4 + e] = q as i8 as u8;
            *o = q as f32 * d;
        }
        for x in &mut b[260..292] {
            *x = r.next() as u8;
        }
    }

    /// Where the 2-bit quant of element e lives in Q2_K/Q3_K `qs`: the quantizer packs
    /// elements j+l, j+l+32, j+l+64, j+l+96 (j ∈ {0,128}, l < 32) into byte j/4 + l.
    fn two_bit_slot(e: usize) -> (usize, usize) {
        ((e / 128) * 32 + e % 32, 2 * ((e % 128) / 32))
    }

    fn enc_q2_k(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (db, d) = r.f16();
        let (mb, dmin) = r.f16();
        put_f16(b, 80, db);
        put_f16(b, 82, mb);
        let sc: Vec<i32> = (0..16).map(|_| r.int(0, 15)).collect();
        let mn: Vec<i32> = (0..16).map(|_| r.int(0, 15)).collect();
        for j in 0..16 {
            b[j] = (sc[j] | (mn[j] << 4)) as u8;
        }
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, 3);
            let (byte, shift) = two_bit_slot(e);
            b[16 + byte] |= (q as u8) << shift;
            *o = d * sc[e / 16] as f32 * q as f32 - dmin * mn[e / 16] as f32;
        }
    }

    fn enc_q3_k(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (db, d) = r.f16();
        put_f16(b, 108, db);
        let sc: Vec<i32> = (0..16).map(|_| r.int(-32, 31)).collect();
        for (j, &s) in sc.iter().enumerate() {
            let l = (s + 32) as u8;
            if j < 8 {
                b[96 + j] |= l & 15;
            } else {
                b[96 + j - 8] |= (l & 15) << 4;
            }
            b[96 + 8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(-4, 3);
            let stored = (q + 4) as u8;
            // the high bit of element e is bit e/32 of hmask[e % 32]
            b[e % 32] |= (stored >> 2) << (e / 32);
            let (byte, shift) = two_bit_slot(e);
            b[32 + byte] |= (stored & 3) << shift;
            *o = d * sc[e / 16] as f32 * q as f32;
        }
    }

    /// Packs 8 six-bit scales and mins the way the Q4_K/Q5_K quantizer does.
    fn pack_scale_min(sc: &[u8], mn: &[u8], s: &mut [u8]) {
        for j in 0..8 {
            if j < 4 {
                s[j] = sc[j];
                s[j + 4] = mn[j];
            } else {
                s[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4);
                s[j - 4] |= (sc[j] >> 4) << 6;
                s[j] |= (mn[j] >> 4) << 6;
            }
        }
    }

    /// Q4_K (`five_bit` false) and Q5_K: 8 sub-blocks of 32 with 6-bit scale and min.
    fn enc_q45_k(r: &mut Rng, b: &mut [u8], out: &mut [f32], five_bit: bool) {
        let (db, d) = r.f16();
        let (mb, dmin) = r.f16();
        put_f16(b, 0, db);
        put_f16(b, 2, mb);
        let sc: Vec<u8> = (0..8).map(|_| r.int(0, 63) as u8).collect();
        let mn: Vec<u8> = (0..8).map(|_| r.int(0, 63) as u8).collect();
        pack_scale_min(&sc, &mn, &mut b[4..16]);
        let qs_at = if five_bit { 48 } else { 16 };
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, if five_bit { 31 } else { 15 }) as u8;
            // 64-element chunks: byte 32·chunk + e%32, low nibble for the chunk's first half
            let byte = 32 * (e / 64) + e % 32;
            b[qs_at + byte] |= (q & 15) << (4 * ((e % 64) / 32));
            if five_bit {
                b[16 + e % 32] |= (q >> 4) << (e / 32);
            }
            let j = e / 32;
            *o = d * sc[j] as f32 * q as f32 - dmin * mn[j] as f32;
        }
    }

    fn enc_q6_k(r: &mut Rng, b: &mut [u8], out: &mut [f32]) {
        let (db, d) = r.f16();
        put_f16(b, 208, db);
        let sc: Vec<i32> = (0..16).map(|_| r.int(-128, 127)).collect();
        for (j, &s) in sc.iter().enumerate() {
            b[192 + j] = s as i8 as u8;
        }
        for (e, o) in out.iter_mut().enumerate() {
            let q = r.int(0, 63) as u8;
            let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
            // ql: elements l and l+64 share byte l, l+32 and l+96 share byte l+32 (per half)
            b[64 * half + 32 * (k % 2) + l] |= (q & 15) << (4 * (k / 2));
            b[128 + 32 * half + l] |= (q >> 4) << (2 * k);
            *o = d * sc[e / 16] as f32 * (q as i32 - 32) as f32;
        }
    }

    #[test]
    fn q4_0_blocks() {
        check(GgmlType::Q4_0, 5, enc_q4_0);
    }

    #[test]
    fn q4_1_blocks() {
        check(GgmlType::Q4_1, 5, enc_q4_1);
    }

    #[test]
    fn q5_0_blocks() {
        check(GgmlType::Q5_0, 5, |r, b, o| enc_q5(r, b, o, false));
    }

    #[test]
    fn q5_1_blocks() {
        check(GgmlType::Q5_1, 5, |r, b, o| enc_q5(r, b, o, true));
    }

    #[test]
    fn q8_blocks() {
        check(GgmlType::Q8_0, 5, enc_q8_0);
        check(GgmlType::Q8_1, 5, enc_q8_1);
        check(GgmlType::Q8_K, 3, enc_q8_k);
    }

    #[test]
    fn q2_k_blocks() {
        check(GgmlType::Q2_K, 4, enc_q2_k);
    }

    #[test]
    fn q3_k_blocks() {
        check(GgmlType::Q3_K, 4, enc_q3_k);
    }

    #[test]
    fn q4_k_blocks() {
        check(GgmlType::Q4_K, 4, |r, b, o| enc_q45_k(r, b, o, false));
    }

    #[test]
    fn q5_k_blocks() {
        check(GgmlType::Q5_K, 4, |r, b, o| enc_q45_k(r, b, o, true));
    }

    #[test]
    fn q6_k_blocks() {
        check(GgmlType::Q6_K, 4, enc_q6_k);
    }

    /// Enough blocks to take the multi-threaded path; blocks must land in order.
    #[test]
    fn large_tensor_splits_across_threads_in_order() {
        let n_blocks = PARALLEL_MIN_ELEMENTS / QK_K + 7;
        check(GgmlType::Q4_K, n_blocks, |r, b, o| {
            enc_q45_k(r, b, o, false)
        });
        check(GgmlType::Q6_K, n_blocks, enc_q6_k);
    }

    /// A hand-written Q4_K block with known numbers, independent of the random encoders:
    /// sub-block j has scale j+1 and min 2j (sub-blocks 4..8 exercise the split 6-bit
    /// packing: scale 60 + j, min 40 + j), every quant = its index within the sub-block % 16.
    #[test]
    fn q4_k_known_values() {
        let d = 0.5f32;
        let dmin = 0.25f32;
        let sc: [u8; 8] = [1, 2, 3, 4, 64 - 4, 61, 62, 63];
        let mn: [u8; 8] = [0, 2, 4, 6, 44, 45, 46, 47];
        let mut b = [0u8; 144];
        put_f16(&mut b, 0, f16::from_f32(d).to_bits());
        put_f16(&mut b, 2, f16::from_f32(dmin).to_bits());
        pack_scale_min(&sc, &mn, &mut b[4..16]);
        // chunk c (64 elements): byte 16 + 32c + l holds element 64c+l (low) and 64c+32+l (high)
        for c in 0..4 {
            for l in 0..32 {
                let q = (l % 16) as u8;
                b[16 + 32 * c + l] = q | (q << 4);
            }
        }
        let mut y = [0f32; 256];
        dequantize(GgmlType::Q4_K, &b, &mut y).expect("dequantize");
        for (e, &v) in y.iter().enumerate() {
            let j = e / 32;
            let q = (e % 32 % 16) as f32;
            let want = d * sc[j] as f32 * q - dmin * mn[j] as f32;
            assert_eq!(v, want, "element {e}");
        }
        // Spot values: element 0 = −0·…, element 255 = 0.5·63·15 − 0.25·47.
        assert_eq!(y[0], 0.0);
        assert_eq!(y[255], 0.5 * 63.0 * 15.0 - 0.25 * 47.0);
    }

    #[test]
    fn float_types() {
        let vals = [0.0f32, -1.5, 3.25, 65504.0, -0.000061035156];
        let mut f32b = Vec::new();
        let mut f16b = Vec::new();
        let mut bf16b = Vec::new();
        for v in vals {
            f32b.extend_from_slice(&v.to_le_bytes());
            f16b.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            bf16b.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
        }
        let mut out = [0f32; 5];
        dequantize(GgmlType::F32, &f32b, &mut out).expect("f32");
        assert_eq!(out, vals);
        dequantize(GgmlType::F16, &f16b, &mut out).expect("f16");
        assert_eq!(out, vals);
        dequantize(GgmlType::BF16, &bf16b, &mut out).expect("bf16");
        let want: Vec<f32> = vals.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(out.to_vec(), want);
        // bf16 is the top half of an f32: 3.25 and -1.5 are exact.
        assert_eq!(out[1], -1.5);
        assert_eq!(out[2], 3.25);
    }

    #[test]
    fn rejects_wrong_sizes_and_unsupported_types() {
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out),
            Err(DequantError::SizeMismatch { expected: 18, .. })
        ));
        let mut odd = [0f32; 33];
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 18], &mut odd).is_err());
        let err = dequantize(GgmlType::IQ2_XXS, &[0u8; 66], &mut [0f32; 256]).unwrap_err();
        assert_eq!(err, DequantError::Unsupported(GgmlType::IQ2_XXS));
        let msg = err.to_string();
        assert!(
            msg.contains("IQ2_XXS") && msg.contains("Q4_K") && msg.contains("Q6_K"),
            "{msg}"
        );
    }
}
