//! Synthetic Kineto-style traces with known structure, for tests and for benchmarks at sizes
//! real fixtures do not reach. The layout follows what the PyTorch profiler writes: a trace
//! object with `distributedInfo` and `deviceProperties`, then one event per few lines, timestamps
//! in microseconds with nanosecond decimals, flow events linking launches to kernels.

use std::io::Write;

/// What to generate. Times are nanoseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthOptions {
    pub rank: u32,
    pub world_size: u32,
    /// Stop after the step during which this many bytes have been written. Default 1 MB.
    pub target_bytes: u64,
    /// Or stop after this many steps, whichever comes first. Default unlimited.
    pub max_steps: Option<u64>,
    /// Compute kernels per step. Default 200.
    pub kernels_per_step: u32,
    /// DataLoader time at the start of every step. Default 2 ms.
    pub dataloader_ns: i64,
    /// Extra DataLoader time per rank number (so that higher ranks straggle). Default 0.
    pub dataloader_ns_per_rank: i64,
    pub seed: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            rank: 0,
            world_size: 1,
            target_bytes: 1_000_000,
            max_steps: None,
            kernels_per_step: 200,
            dataloader_ns: 2_000_000,
            dataloader_ns_per_rank: 0,
            seed: 1,
        }
    }
}

const KERNELS: [&str; 4] = [
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
];
const OPS: [&str; 4] = ["aten::mm", "aten::gelu", "aten::_softmax", "aten::addmm"];

struct Writer<W: Write> {
    out: W,
    buf: String,
    written: u64,
    first: bool,
    pid: u32,
    corr: u64,
}

fn us(ns: i64) -> String {
    let sign = if ns < 0 { "-" } else { "" };
    let a = ns.unsigned_abs();
    format!("{sign}{}.{:03}", a / 1000, a % 1000)
}

impl<W: Write> Writer<W> {
    fn event(&mut self, body: std::fmt::Arguments<'_>) -> std::io::Result<()> {
        use std::fmt::Write as _;
        self.buf.clear();
        if !self.first {
            self.buf.push_str(",\n");
        }
        self.first = false;
        let _ = self.buf.write_fmt(body);
        self.out.write_all(self.buf.as_bytes())?;
        self.written += self.buf.len() as u64;
        Ok(())
    }

    fn span(&mut self, cat: &str, name: &str, tid: u32, ts: i64, dur: i64, args: &str) -> std::io::Result<()> {
        let pid = self.pid;
        self.event(format_args!(
            "  {{\n    \"ph\": \"X\", \"cat\": \"{cat}\", \"name\": \"{name}\", \"pid\": {}, \"tid\": {tid},\n    \"ts\": {}, \"dur\": {},\n    \"args\": {{{args}}}\n  }}",
            pid,
            us(ts),
            us(dur)
        ))
    }

    /// A runtime launch at `ts` and its GPU work on `stream` at `gpu_ts`, linked by a flow.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        runtime: &str,
        tid: u32,
        ts: i64,
        cat: &str,
        name: &str,
        stream: u32,
        gpu_ts: i64,
        gpu_dur: i64,
        extra: &str,
    ) -> std::io::Result<()> {
        self.corr += 1;
        let c = self.corr;
        let pid = self.pid;
        self.span(
            "cuda_runtime",
            runtime,
            tid,
            ts,
            4_500,
            &format!("\"External id\": {c}, \"cbid\": 211, \"correlation\": {c}"),
        )?;
        self.event(format_args!("  {{\"ph\": \"s\", \"id\": {c}, \"pid\": {}, \"tid\": {tid}, \"ts\": {}, \"cat\": \"ac2g\", \"name\": \"ac2g\"}}", pid, us(ts)))?;
        self.event(format_args!(
            "  {{\n    \"ph\": \"X\", \"cat\": \"{cat}\", \"name\": \"{name}\", \"pid\": 0, \"tid\": {stream},\n    \"ts\": {}, \"dur\": {},\n    \"args\": {{\"External id\": {c}, \"queued\": 0, \"device\": 0, \"context\": 1, \"stream\": {stream}, \"correlation\": {c}{extra}}}\n  }}",
            us(gpu_ts),
            us(gpu_dur)
        ))?;
        self.event(format_args!("  {{\"ph\": \"f\", \"id\": {c}, \"pid\": 0, \"tid\": {stream}, \"ts\": {}, \"cat\": \"ac2g\", \"name\": \"ac2g\", \"bp\": \"e\"}}", us(gpu_ts)))
    }
}

/// Writes one rank's synthetic trace; returns the bytes written.
pub fn write_synthetic(out: impl Write, opts: &SynthOptions) -> std::io::Result<u64> {
    let mut w = Writer {
        out: std::io::BufWriter::with_capacity(1 << 20, out),
        buf: String::new(),
        written: 0,
        first: true,
        pid: 4000 + opts.rank,
        corr: 0,
    };
    let header = format!(
        "{{\n  \"schemaVersion\": 1,\n  \"distributedInfo\": {{\"backend\": \"nccl\", \"rank\": {}, \"world_size\": {}}},\n  \"deviceProperties\": [\n    {{\n      \"id\": 0, \"name\": \"NVIDIA A100-SXM4-80GB\", \"totalGlobalMem\": 85097971712,\n      \"computeMajor\": 8, \"computeMinor\": 0, \"numSms\": 108\n    }}\n  ],\n  \"traceEvents\": [\n",
        opts.rank, opts.world_size
    );
    w.out.write_all(header.as_bytes())?;
    w.written += header.len() as u64;
    let main_tid = w.pid;
    let mut rng = opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut t: i64 = 1_700_000_000_000_000_123;
    let mut gpu_free = t;
    let mut step: u64 = 0;
    while w.written < opts.target_bytes && opts.max_steps.is_none_or(|m| step < m) {
        let step_start = t;
        // The step's own span is written after its children, once its end is known; the
        // analyzer sorts events, as it must for real traces too.
        let dl = opts.dataloader_ns + opts.dataloader_ns_per_rank * i64::from(opts.rank);
        w.span(
            "user_annotation",
            "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            main_tid,
            t,
            dl,
            "\"External id\": 1",
        )?;
        t += dl + 1_000;
        w.launch(
            "cudaMemcpyAsync",
            main_tid,
            t,
            "gpu_memcpy",
            "Memcpy HtoD (Pinned -> Device)",
            7,
            t.max(gpu_free) + 3_000,
            250_000,
            ", \"bytes\": 4194304, \"memory bandwidth (GB/s)\": 16.7",
        )?;
        gpu_free = gpu_free.max(t + 3_000) + 250_000;
        t += 6_000;
        for k in 0..opts.kernels_per_step {
            let which = (next() % 4) as usize;
            let op_dur = 12_000 + (next() % 4_000) as i64;
            w.span(
                "cpu_op",
                OPS[which],
                main_tid,
                t,
                op_dur,
                &format!("\"External id\": {}, \"Sequence number\": {k}", w.corr + 1),
            )?;
            let launch_at = t + 3_000;
            let gpu_ts = (launch_at + 6_000).max(gpu_free + 1_500);
            let gpu_dur = 20_000 + (next() % 60_000) as i64;
            w.launch(
                "cudaLaunchKernel",
                main_tid,
                launch_at,
                "kernel",
                KERNELS[which],
                7,
                gpu_ts,
                gpu_dur,
                ", \"registers per thread\": 64, \"grid\": [108, 1, 1], \"block\": [256, 1, 1]",
            )?;
            gpu_free = gpu_ts + gpu_dur;
            t += op_dur + 1_000;
        }
        // Gradient all-reduce on its own stream, overlapping the tail of the compute.
        let comm_ts = gpu_free - 200_000;
        w.span("user_annotation", "nccl:all_reduce", main_tid, t, 20_000, "\"External id\": 2")?;
        w.launch(
            "cudaLaunchKernel",
            main_tid,
            t + 5_000,
            "kernel",
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            20,
            comm_ts.max(t + 9_000),
            600_000,
            "",
        )?;
        let comm_end = comm_ts.max(t + 9_000) + 600_000;
        t += 21_000;
        w.span("cpu_op", "Optimizer.step#AdamW.step", main_tid, t, 300_000, "\"External id\": 3")?;
        t += 300_000;
        // The step waits for the GPU (a synchronising .item()).
        let end = t.max(gpu_free).max(comm_end) + 5_000;
        w.span("cuda_runtime", "cudaStreamSynchronize", main_tid, t, end - t, "\"cbid\": 131")?;
        step += 1;
        let name = format!("ProfilerStep#{step}");
        w.span("user_annotation", &name, main_tid, step_start, end - step_start, "\"External id\": 0")?;
        t = end + 10_000;
        gpu_free = gpu_free.max(comm_end);
    }
    let tail = "\n  ],\n  \"traceName\": \"synthetic\"\n}\n";
    w.out.write_all(tail.as_bytes())?;
    w.written += tail.len() as u64;
    w.out.flush()?;
    Ok(w.written)
}
