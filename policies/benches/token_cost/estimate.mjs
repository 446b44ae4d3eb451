// Compares canarygate's high completion-token estimate (the cut at a
// client's max_tokens without a tokenizer_file) with real tokenizers on the
// samples on stdin (one JSON object per line, from `cargo run -p
// canarygate-policies --example estimate_cases`): o200k_base, cl100k_base
// (npm gpt-tokenizer) and Llama 3 (npm llama3-tokenizer-js). Prints the
// estimate over the highest real count per sample; exits non-zero when the
// estimate counts fewer tokens than any tokenizer on any sample (a cut would
// then deliver more than the client's limit).
import { createInterface } from 'node:readline'
import { encode as o200k } from 'gpt-tokenizer/encoding/o200k_base'
import { encode as cl100k } from 'gpt-tokenizer/encoding/cl100k_base'
import llama3 from 'llama3-tokenizer-js'

let failed = false
console.log('sample\to200k_base\tcl100k_base\tLlama 3\testimate\testimate / highest')
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue
  const { name, text, estimate } = JSON.parse(line)
  const counts = [o200k(text).length, cl100k(text).length, llama3.encode(text, { bos: false, eos: false }).length]
  const highest = Math.max(...counts)
  const ratio = estimate / highest
  failed ||= ratio < 1
  console.log([name, ...counts, estimate, ratio.toFixed(2)].join('\t'))
}
if (failed) {
  console.error('the estimate counted fewer tokens than a real tokenizer')
  process.exit(1)
}
