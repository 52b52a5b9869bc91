// llama.cpp's next-token probabilities after every position of a token list, through node-llama-cpp:
//   node tests/llama_cpp_logprobs.mjs NODE_LLAMA_CPP_DIR MODEL.gguf OUT.f32 TOKEN_ID...
// Writes float32 (positions, vocabulary) little-endian: every token's probability (temperature 1, no truncation).
import {pathToFileURL} from "node:url";
import {writeFileSync} from "node:fs";

const [dir, model, out, ...ids] = process.argv.slice(2);
const {getLlama} = await import(pathToFileURL(`${dir}/node_modules/node-llama-cpp/dist/index.js`).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const m = await llama.loadModel({modelPath: model});
const context = await m.createContext({contextSize: 512, batchSize: 512, threads: 1});
const next = {probabilities: true, options: {temperature: 1, topK: 0, topP: 1, minP: 0}};
const results = await context.getSequence().controlledEvaluate(ids.map((t) => [Number(t), {generateNext: next}]));
const V = results[0].next.probabilities.size;   // every token of the vocabulary has a probability
const probs = new Float32Array(results.length * V);
results.forEach((r, i) => { for (const [token, p] of r.next.probabilities) probs[i * V + token] = p; });
writeFileSync(out, Buffer.from(probs.buffer));
await context.dispose(); await m.dispose(); await llama.dispose();
