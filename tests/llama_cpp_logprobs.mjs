// llama.cpp's next-token probabilities for every position of a token list, through node-llama-cpp:
//   node tests/llama_cpp_logprobs.mjs NODE_LLAMA_CPP_DIR MODEL.gguf OUT.json TOKEN_ID...
// Writes {"probs": [[[token, p], ...] per position]}: every vocabulary token (temperature 1, no truncation).
import {pathToFileURL} from "node:url";
import {writeFileSync} from "node:fs";

const [dir, model, out, ...ids] = process.argv.slice(2);
const {getLlama} = await import(pathToFileURL(`${dir}/node_modules/node-llama-cpp/dist/index.js`).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const m = await llama.loadModel({modelPath: model});
const context = await m.createContext({contextSize: 512, batchSize: 512, threads: 1});
const sequence = context.getSequence();
const tokens = ids.map(Number);
const next = {probabilities: true, options: {temperature: 1, topK: 0, topP: 1, minP: 0}};
const results = await sequence.controlledEvaluate(tokens.map((t) => [t, {generateNext: next}]));
const probs = results.map((r) => Array.from(r.next.probabilities.entries()));  // [[token, p], ...] per position
writeFileSync(out, JSON.stringify({probs}));
await context.dispose(); await m.dispose(); await llama.dispose();
