//! Small-batch linear layers on the CPU: `y[m, n] = x[m, k] · w[n, k]ᵀ` for f32 and few rows.
//!
//! A decode step multiplies a handful of rows (one per running request) by every weight matrix.
//! A general GEMM packs the weights into panels on every call, so at `m = 8` it reads and writes
//! each weight several times and runs at the speed of that copy: measured on the development VM,
//! candle's CPU matmul took 4.5–8× as long at 8 rows as at 1. This kernel streams each weight row
//! once, straight from its row-major storage, and computes its dot products with all `m` input
//! rows while the row is in L1: a batch of 8 costs little more than a batch of 1 as long as the
//! weights, not the arithmetic, are the bottleneck.
//!
//! Used through [`SmallBatchLinear`], a candle custom op, only for CPU f32 tensors with at most
//! [`MAX_ROWS`] rows; everything else stays on candle's matmul.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape};
use rayon::prelude::*;

/// Most input rows the kernel takes; larger batches (prefill chunks) go through candle's GEMM,
/// which is compute-efficient there.
pub(crate) const MAX_ROWS: usize = 16;

/// Weight rows per parallel task: large enough to amortise scheduling, small enough that both
/// cores get work for the smallest projections of a ~100M model.
const ROWS_PER_TASK: usize = 96;

/// `x · wᵀ` as a candle op: `x` is `[m, k]`, `w` is `[n, k]` (a linear layer's weight), both
/// f32; the result is `[m, n]`.
pub(crate) struct SmallBatchLinear;

impl CustomOp2 for SmallBatchLinear {
    fn name(&self) -> &'static str {
        "small-batch-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (x, w) else {
            candle_core::bail!("small-batch-linear takes f32 tensors");
        };
        let ((m, k), (n, k_w)) = (x_layout.shape().dims2()?, w_layout.shape().dims2()?);
        if k != k_w {
            candle_core::bail!("small-batch-linear: x is [{m}, {k}] but w is [{n}, {k_w}]");
        }
        let (Some((x_start, x_end)), Some((w_start, w_end))) =
            (x_layout.contiguous_offsets(), w_layout.contiguous_offsets())
        else {
            candle_core::bail!("small-batch-linear takes contiguous tensors");
        };
        let mut y = vec![0f32; m * n];
        // k = 0: every dot product is empty, y stays zero.
        if k > 0 {
            linear(&x[x_start..x_end], &w[w_start..w_end], k, &mut y);
        }
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ`, all row-major; `m` and `n` follow from the slice lengths.
///
/// Parallel over blocks of weight rows (columns of `y`).
pub(crate) fn linear(x: &[f32], w: &[f32], k: usize, y: &mut [f32]) {
    assert!(
        k > 0 && x.len().is_multiple_of(k) && w.len().is_multiple_of(k),
        "bad linear shapes"
    );
    let (m, n) = (x.len() / k, w.len() / k);
    assert_eq!(y.len(), m * n, "y must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    // Cut every output row into column blocks; block b of every row belongs to task b.
    let mut row_blocks: Vec<_> = y
        .chunks_mut(n)
        .map(|row| row.chunks_mut(ROWS_PER_TASK))
        .collect();
    let tasks: Vec<Vec<&mut [f32]>> = (0..n.div_ceil(ROWS_PER_TASK))
        .map(|_| {
            row_blocks
                .iter_mut()
                .map(|blocks| blocks.next().expect("every row has the same blocks"))
                .collect()
        })
        .collect();
    tasks.into_par_iter().enumerate().for_each(|(b, mut out)| {
        let j0 = b * ROWS_PER_TASK;
        let rows = out[0].len();
        block(x, &w[j0 * k..(j0 + rows) * k], k, &mut out);
    });
}

/// Output rows at a time and weight rows at a time of the inner tile: 4 × 3 accumulators of
/// 8 lanes fill 12 of AVX2's 16 vector registers, leaving room for the 3 weight vectors and
/// one input vector.
const TILE_M: usize = 4;
const TILE_N: usize = 3;

/// One task: `out[i][j] = x_i · w_j` for every input row `i` and the task's weight rows `j`.
fn block(x: &[f32], w: &[f32], k: usize, out: &mut [&mut [f32]]) {
    let (m, n) = (x.len() / k, w.len() / k);
    let mut j = 0;
    while j < n {
        let nt = TILE_N.min(n - j);
        let w_tile = &w[j * k..(j + nt) * k];
        let mut i = 0;
        while i < m {
            let mt = TILE_M.min(m - i);
            let x_tile = &x[i * k..(i + mt) * k];
            let mut sums = [[0f32; TILE_N]; TILE_M];
            dot_tile(x_tile, w_tile, k, mt, nt, &mut sums);
            for (di, sums_row) in sums.iter().enumerate().take(mt) {
                out[i + di][j..j + nt].copy_from_slice(&sums_row[..nt]);
            }
            i += mt;
        }
        j += nt;
    }
}

/// Dot products of `mt` rows of `x` with `nt` rows of `w` (rows of length `k`) into `sums`.
fn dot_tile(
    x: &[f32],
    w: &[f32],
    k: usize,
    mt: usize,
    nt: usize,
    sums: &mut [[f32; TILE_N]; TILE_M],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        unsafe { avx2::dot_tile(x, w, k, mt, nt, sums) };
        return;
    }
    portable_dot_tile(x, w, k, mt, nt, sums);
}

/// The reference dot products, for CPUs without AVX2 + FMA and for the tests.
fn portable_dot_tile(
    x: &[f32],
    w: &[f32],
    k: usize,
    mt: usize,
    nt: usize,
    sums: &mut [[f32; TILE_N]; TILE_M],
) {
    for (i, sums_row) in sums.iter_mut().enumerate().take(mt) {
        let x_row = &x[i * k..(i + 1) * k];
        for (j, sum) in sums_row.iter_mut().enumerate().take(nt) {
            let w_row = &w[j * k..(j + 1) * k];
            *sum = x_row.iter().zip(w_row).map(|(a, b)| a * b).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{TILE_M, TILE_N};

    /// AVX2 + FMA version of [`super::portable_dot_tile`]: dispatches to a tile with the
    /// sizes fixed at compile time, so its accumulators live in registers.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_tile(
        x: &[f32],
        w: &[f32],
        k: usize,
        mt: usize,
        nt: usize,
        sums: &mut [[f32; TILE_N]; TILE_M],
    ) {
        macro_rules! dispatch {
            ($(($m:literal, $n:literal)),*) => {
                match (mt, nt) {
                    $(($m, $n) => tile::<$m, $n>(x, w, k, sums),)*
                    _ => unreachable!("tile sizes are at most {TILE_M} x {TILE_N}"),
                }
            };
        }
        dispatch!(
            (4, 3),
            (4, 2),
            (4, 1),
            (3, 3),
            (3, 2),
            (3, 1),
            (2, 3),
            (2, 2),
            (2, 1),
            (1, 3),
            (1, 2),
            (1, 1)
        )
    }

    /// `MT` rows of `x` against `NT` rows of `w`, eight lanes of `k` at a time.
    #[target_feature(enable = "avx2,fma")]
    fn tile<const MT: usize, const NT: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        sums: &mut [[f32; TILE_N]; TILE_M],
    ) {
        assert!(x.len() >= MT * k && w.len() >= NT * k);
        let lanes = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); NT]; MT];
        let mut p = 0;
        while p < lanes {
            let mut w_vec = [_mm256_setzero_ps(); NT];
            for (j, w_vec) in w_vec.iter_mut().enumerate() {
                // SAFETY: p + 8 <= k, so the 8 floats at j * k + p lie inside w's row j.
                *w_vec = unsafe { _mm256_loadu_ps(w.as_ptr().add(j * k + p)) };
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                // SAFETY: as above, inside x's row i.
                let x_vec = unsafe { _mm256_loadu_ps(x.as_ptr().add(i * k + p)) };
                for (acc, w_vec) in acc_row.iter_mut().zip(&w_vec) {
                    *acc = _mm256_fmadd_ps(x_vec, *w_vec, *acc);
                }
            }
            p += 8;
        }
        for (i, acc_row) in acc.iter().enumerate() {
            for (j, acc) in acc_row.iter().enumerate() {
                let tail: f32 = (lanes..k).map(|q| x[i * k + q] * w[j * k + q]).sum();
                sums[i][j] = horizontal_sum(*acc) + tail;
            }
        }
    }

    /// Sum of the eight lanes.
    #[target_feature(enable = "avx2,fma")]
    fn horizontal_sum(v: __m256) -> f32 {
        let pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pairs = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
        let single = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
        _mm_cvtss_f32(single)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The kernel against candle's matmul for every tile remainder, odd `k` (a scalar tail)
    /// and more weight rows than one task.
    #[test]
    fn matches_candle_matmul() {
        let dev = Device::Cpu;
        for (m, n, k) in [
            (1, 1, 1),
            (1, 7, 8),
            (3, 5, 13),
            (4, 3, 64),
            (5, 200, 37),
            (8, 1280, 768),
            (16, 97, 100),
            (2, 3, 0),
        ] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev).unwrap();
            let w = Tensor::randn(0f32, 1., (n, k), &dev).unwrap();
            let expected = x.matmul(&w.t().unwrap()).unwrap();
            let got = x.apply_op2_no_bwd(&w, &SmallBatchLinear).unwrap();
            assert_eq!(got.dims(), &[m, n]);
            let err = (got - &expected)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let scale = expected
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(err <= 1e-5 * scale.max(1.0), "m={m} n={n} k={k}: {err}");
        }
    }

    #[test]
    fn portable_and_vector_tiles_agree() {
        let k = 29;
        let x: Vec<f32> = (0..TILE_M * k).map(|v| (v as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..TILE_N * k).map(|v| (v as f32 * 0.11).cos()).collect();
        for mt in 1..=TILE_M {
            for nt in 1..=TILE_N {
                let mut fast = [[0f32; TILE_N]; TILE_M];
                let mut slow = [[0f32; TILE_N]; TILE_M];
                dot_tile(&x, &w, k, mt, nt, &mut fast);
                portable_dot_tile(&x, &w, k, mt, nt, &mut slow);
                for i in 0..TILE_M {
                    for j in 0..TILE_N {
                        assert!(
                            (fast[i][j] - slow[i][j]).abs() < 1e-4,
                            "{mt}x{nt} at {i},{j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_non_contiguous_input() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (8, 4), &dev).unwrap().t().unwrap();
        let w = Tensor::randn(0f32, 1., (3, 8), &dev).unwrap();
        let err = x.apply_op2_no_bwd(&w, &SmallBatchLinear).unwrap_err();
        assert!(err.to_string().contains("contiguous"), "{err}");
    }
}
