// Compares canarygate's two token estimates with real tokenizers on the
// samples on stdin (one JSON object per line, from `cargo run -p
// canarygate-policies --example estimate_cases`): o200k_base, cl100k_base
// (npm gpt-tokenizer) and Llama 3 (npm llama3-tokenizer-js).
//
// - The high completion-token estimate (the cut at a client's max_tokens
//   without a tokenizer_file), over the highest real count per sample: it
//   must never count fewer than any tokenizer (a cut would then deliver more
//   than the client's limit).
// - The prompt estimate (the `prompt_tokens` check and the context
//   preflight without a tokenizer_file), over the lowest real count: it must
//   stay under PROMPT_CEILING, so that an honest provider's count stays well
//   above the check's floor (estimate_min_ratio 0.25 by default).
//
// Exits non-zero when either bound is broken.
import { createInterface } from 'node:readline'
import { encode as o200k } from 'gpt-tokenizer/encoding/o200k_base'
import { encode as cl100k } from 'gpt-tokenizer/encoding/cl100k_base'
import llama3 from 'llama3-tokenizer-js'

const PROMPT_CEILING = 3

let failed = false
console.log('sample\to200k_base\tcl100k_base\tLlama 3\testimate\testimate / highest\tprompt estimate\tprompt estimate / lowest')
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue
  const { name, text, estimate, prompt_estimate: promptEstimate } = JSON.parse(line)
  const counts = [o200k(text).length, cl100k(text).length, llama3.encode(text, { bos: false, eos: false }).length]
  const highest = Math.max(...counts)
  const lowest = Math.min(...counts)
  const ratio = estimate / highest
  const promptRatio = promptEstimate / lowest
  if (ratio < 1) {
    console.error(`${name}: the high estimate counted fewer tokens than a real tokenizer`)
    failed = true
  }
  if (promptRatio > PROMPT_CEILING) {
    console.error(`${name}: the prompt estimate counted more than ${PROMPT_CEILING}x a real tokenizer`)
    failed = true
  }
  console.log([name, ...counts, estimate, ratio.toFixed(2), promptEstimate, promptRatio.toFixed(2)].join('\t'))
}
if (failed) {
  process.exit(1)
}
