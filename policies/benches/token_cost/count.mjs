// Counts what canarygate adds to each request of the cases on stdin (one JSON
// object per line, from `cargo run -p canarygate-policies --example
// token_cost_cases`), with two real tokenizers:
//   - OpenAI o200k_base, with OpenAI's chat framing (gpt-tokenizer's
//     encodeChat for gpt-4o);
//   - Llama 3, with its chat template's framing (<|start_header_id|>role
//     <|end_header_id|>\n\n content <|eot_id|>, then the assistant header).
// Prompt overhead: tokens of the injected messages minus the client's own.
// Completion overhead: tokens of the echo, a line break and the answer minus
// the answer's own. Prints medians (and maxima) before and after, and checks
// the targets on short single-message prompts: median <= 64 prompt tokens,
// <= 16 completion tokens, in both tokenizers; and that no echo costs more
// than the output tokens canarygate adds for it to an OpenAI or Llama 3
// model's limit (the cases' `allowance`).
import { createInterface } from 'node:readline'
import { encode as o200k, encodeChat } from 'gpt-tokenizer/model/gpt-4o'
import llama3 from 'llama3-tokenizer-js'

const PROMPT_TARGET = 64
const COMPLETION_TARGET = 16

const tokenizers = {
  o200k_base: {
    prompt: (messages) => encodeChat(messages.map(({ role, content }) => ({ role, content }))).length,
    text: (text) => o200k(text).length,
  },
  'Llama 3': {
    prompt: (messages) => {
      let rendered = ''
      for (const { role, content } of messages) {
        rendered += `<|start_header_id|>${role}<|end_header_id|>\n\n${content}<|eot_id|>`
      }
      rendered += '<|start_header_id|>assistant<|end_header_id|>\n\n'
      return llama3.encode(rendered, { bos: true, eos: false }).length
    },
    text: (text) => llama3.encode(text, { bos: false, eos: false }).length,
  },
}

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b)
  const middle = sorted.length >> 1
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2
}

const rows = new Map()
const allowance = { most: 0, given: 0, fits: true }
const lines = createInterface({ input: process.stdin })
for await (const line of lines) {
  if (!line.trim()) continue
  const c = JSON.parse(line)
  for (const [name, tok] of Object.entries(tokenizers)) {
    const key = `${c.system ? 'with a system prompt' : 'single user message'}|${name}`
    if (!rows.has(key)) rows.set(key, { before: { prompt: [], completion: [] }, after: { prompt: [], completion: [] } })
    const row = rows.get(key)
    const client = tok.prompt(c.client)
    const answer = tok.text(c.answer)
    for (const format of ['before', 'after']) {
      const { messages, echo } = c[format]
      row[format].prompt.push(tok.prompt(messages) - client)
      row[format].completion.push(tok.text(`${echo}\n${c.answer}`) - answer)
    }
    // The output tokens canarygate adds to the client's limit for this echo:
    // an echo that costs more eats the client's budget.
    const echoCost = row.after.completion[row.after.completion.length - 1]
    allowance.most = Math.max(allowance.most, echoCost)
    allowance.given = c.allowance
    allowance.fits &&= echoCost <= c.allowance
  }
}

console.log('| requests | tokenizer | prompt tokens added, before | after | completion tokens added, before | after |')
console.log('|---|---|---:|---:|---:|---:|')
let met = true
for (const [key, row] of rows) {
  const [requests, name] = key.split('|')
  const cell = (values) => `${median(values)} (max ${Math.max(...values)})`
  console.log(`| ${requests} | ${name} | ${cell(row.before.prompt)} | ${cell(row.after.prompt)} | ${cell(row.before.completion)} | ${cell(row.after.completion)} |`)
  if (requests === 'single user message') {
    met &&= median(row.after.prompt) <= PROMPT_TARGET && median(row.after.completion) <= COMPLETION_TARGET
  }
}
const count = [...rows.values()][0].after.prompt.length
console.log()
console.log(`medians over ${count} requests per row (max in brackets).`)
console.log(`targets on single user messages (median <= ${PROMPT_TARGET} prompt, <= ${COMPLETION_TARGET} completion tokens, both tokenizers): ${met ? 'met' : 'NOT met'}`)
console.log(`the echo's allowance for OpenAI and Llama 3 models: ${allowance.given} output tokens; the echo cost at most ${allowance.most}: ${allowance.fits ? 'fits' : 'does NOT fit'}`)
process.exitCode = met && allowance.fits ? 0 : 1
