// llama.cpp's prefill and decode speed on a GGUF, through node-llama-cpp (CPU, `threads` threads):
//   node tools/llama_cpp_speed.mjs NODE_LLAMA_CPP_DIR MODEL.gguf THREADS PROMPT_TOKENS DECODE_TOKENS
// Prints {"prefill_tps": ..., "decode_tps": ...}: a prompt of token ids 1000, 1001, ... evaluated at once (its
// time is the prefill), then DECODE_TOKENS tokens generated greedily one at a time (their time is the decode).
import {pathToFileURL} from "node:url";

const [dir, model, threads, promptTokens, decodeTokens] = process.argv.slice(2);
const {getLlama} = await import(pathToFileURL(`${dir}/node_modules/node-llama-cpp/dist/index.js`).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const m = await llama.loadModel({modelPath: model});
const context = await m.createContext({contextSize: 2048, batchSize: 512, threads: Number(threads)});
const sequence = context.getSequence();
const prompt = Array.from({length: Number(promptTokens)}, (_, i) => 1000 + i);
let start = performance.now();
await sequence.evaluateWithoutGeneratingNewTokens(prompt.slice(0, -1));
const prefill = (performance.now() - start) / 1000;
let n = 0;
start = performance.now();
for await (const token of sequence.evaluate(prompt.slice(-1), {temperature: 0})) {
    if (++n >= Number(decodeTokens)) break;
}
const decode = (performance.now() - start) / 1000;
console.log(JSON.stringify({prefill_tps: (prompt.length - 1) / prefill, decode_tps: n / decode}));
await context.dispose(); await m.dispose(); await llama.dispose();
