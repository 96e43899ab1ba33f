use super::{decode, decode_add, encode, reduce, Compression, Isa, Reencode};

/// Values of every kind the kernels must treat alike: magnitudes from subnormal to near
/// f32::MAX in blocks of their own, signed zeros, a block of zeros, and (with `specials`)
/// an inf and a NaN.
fn values(seed: u64, len: usize, specials: bool) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v: Vec<f32> = (0..len)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let magnitude = [1e-3f32, 30.0, 1e-37, 1e-40, 3e37, 1.0, 0.0][(i / 37) % 7];
            unit * magnitude
        })
        .collect();
    for (i, x) in v.iter_mut().enumerate() {
        if i % 101 == 3 {
            *x = -0.0;
        }
    }
    if specials && len > 40 {
        v[len / 3] = f32::INFINITY;
        v[len / 2] = f32::NAN;
        v[len - 5] = f32::NEG_INFINITY;
        v[len - 1] = f32::from_bits(0x7fa0_0001); // a signalling NaN with a payload
    }
    v
}

/// Each value's bits, every NaN as the one quiet NaN: which of two NaN operands' payloads an
/// addition keeps depends on the operands' order, which the compiler may swap (an addition
/// commutes), so an optimized build's scalar code gave 0x7fe00001 where AVX2 gave 0x7fe00000
/// for the same two NaNs. Every other value must match bit for bit.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() }).collect()
}

const CODECS: [Compression; 9] = [
    Compression::None,
    Compression::Bf16,
    Compression::Int8 { block: 1 },
    Compression::Int8 { block: 7 },
    Compression::Int8 { block: 16 },
    Compression::Int8 { block: 33 },
    Compression::Int8 { block: 64 },
    Compression::Int8 { block: 256 },
    Compression::Int8 { block: 1000 },
];
const LENS: [usize; 11] = [0, 1, 15, 16, 17, 255, 256, 257, 1000, 2049, 4099];

/// One implementation's outputs for one case, to compare with the scalar's.
#[derive(Debug, PartialEq, Eq)]
struct Outputs {
    payload: Vec<u8>,
    residual: Vec<u32>,
    plain_payload: Vec<u8>,
    decoded: Vec<u32>,
    added: Vec<u32>,
    reduced: Vec<u32>,
    scattered: Vec<u32>,
    second_payload: Vec<u8>,
    second_residual: Vec<u32>,
    unfed: Vec<u32>,
    unfed_payload: Vec<u8>,
}

fn run(isa: Isa, codec: Compression, len: usize, specials: bool, n: usize) -> Outputs {
    let bytes = codec.payload_bytes(len);
    let input = values(1, len, specials);
    // A residual carried from an earlier step.
    let mut residual: Vec<f32> = values(2, len, false).iter().map(|x| x * 1e-3).collect();
    let mut payload = vec![0u8; bytes];
    encode(isa, codec, &input, &mut payload, Some(&mut residual));
    let mut plain_payload = vec![0u8; bytes];
    encode(isa, codec, &input, &mut plain_payload, None);
    let mut decoded = vec![7f32; len];
    decode(isa, codec, &payload, &mut decoded);
    let mut added = values(3, len, specials);
    decode_add(isa, codec, &payload, &mut added);

    // n ranks' payloads of one shard, reduced with and without the second encoding.
    let payloads: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            let mut p = vec![0u8; bytes];
            encode(Isa::Scalar, codec, &values(10 + r as u64, len, specials && r == 1), &mut p, None);
            p
        })
        .collect();
    let views: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    let mut scattered = vec![1f32; len];
    reduce(isa, codec, &views, n as f32, &mut scattered, None);
    let mut reduced = vec![1f32; len];
    let mut second_payload = vec![0u8; bytes];
    let mut second_residual: Vec<f32> = values(4, len, false).iter().map(|x| x * 1e-2).collect();
    let reencode = Reencode { payload: &mut second_payload, residual: Some(&mut second_residual) };
    reduce(isa, codec, &views, n as f32, &mut reduced, Some(reencode));
    let mut unfed = vec![1f32; len];
    let mut unfed_payload = vec![0u8; bytes];
    reduce(isa, codec, &views, n as f32, &mut unfed, Some(Reencode { payload: &mut unfed_payload, residual: None }));
    Outputs {
        payload,
        residual: bits(&residual),
        plain_payload,
        decoded: bits(&decoded),
        added: bits(&added),
        reduced: bits(&reduced),
        scattered: bits(&scattered),
        second_payload,
        second_residual: bits(&second_residual),
        unfed: bits(&unfed),
        unfed_payload,
    }
}

#[test]
fn every_vector_implementation_gives_the_scalar_bits() {
    let isas = Isa::available();
    eprintln!("implementations on this CPU: {isas:?} (best {:?})", Isa::best());
    for codec in CODECS {
        for len in LENS {
            for specials in [false, true] {
                for n in [1usize, 2, 3] {
                    let want = run(Isa::Scalar, codec, len, specials, n);
                    for &isa in &isas[1..] {
                        let got = run(isa, codec, len, specials, n);
                        assert!(
                            got == want,
                            "{isa:?} differs from the scalar code: {codec:?}, {len} values, specials {specials}, \
                             {n} payloads:\n{}",
                            first_difference(&got, &want)
                        );
                    }
                }
            }
        }
    }
}

fn first_difference(got: &Outputs, want: &Outputs) -> String {
    fn at<T: PartialEq + std::fmt::Debug>(name: &str, a: &[T], b: &[T]) -> Option<String> {
        let i = a.iter().zip(b).position(|(x, y)| x != y)?;
        Some(format!("{name}[{i}]: {:?} against the scalar's {:?}", a[i], b[i]))
    }
    [
        at("payload", &got.payload, &want.payload),
        at("residual", &got.residual, &want.residual),
        at("plain_payload", &got.plain_payload, &want.plain_payload),
        at("decoded", &got.decoded, &want.decoded),
        at("added", &got.added, &want.added),
        at("reduced", &got.reduced, &want.reduced),
        at("scattered", &got.scattered, &want.scattered),
        at("second_payload", &got.second_payload, &want.second_payload),
        at("second_residual", &got.second_residual, &want.second_residual),
        at("unfed", &got.unfed, &want.unfed),
        at("unfed_payload", &got.unfed_payload, &want.unfed_payload),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join("\n")
}

#[test]
fn special_blocks_decode_as_defined() {
    // Checked on the best implementation; the test above ties the others to it.
    let isa = Isa::best();
    let codec = Compression::Int8 { block: 4 };
    let values = [0.0, -0.0, 0.0, 0.0, 1.0, f32::INFINITY, 2.0, 3.0, 1e-38, 5e-39, -1e-38, 0.0];
    let mut payload = vec![0u8; codec.payload_bytes(values.len())];
    let mut residual = vec![0f32; values.len()];
    encode(isa, codec, &values, &mut payload, Some(&mut residual));
    let mut decoded = vec![1f32; values.len()];
    decode(isa, codec, &payload, &mut decoded);
    assert_eq!(bits(&decoded[..4]), [0; 4], "a zero block decodes to +0.0");
    assert!(decoded[4..8].iter().all(|v| v.to_bits() == f32::NAN.to_bits()), "{decoded:?}");
    assert_eq!(&residual[..8], &[0.0; 8], "no residual from zero and non-finite blocks");
    // A block too small for its inverse step (127 / max overflows) sends zeros and keeps
    // everything in its residual, as the definition does.
    assert_eq!(&decoded[8..], &[0.0; 4]);
    assert_eq!(bits(&residual[8..]), bits(&values[8..]));
}
