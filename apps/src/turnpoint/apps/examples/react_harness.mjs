// The ReAct harness of react_harness.py, in Node 20 with plain fetch and no npm
// dependency: a harness that knows nothing of turnpoint (docs/spec.md sections 12.8 and
// 12.9). It reads OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL as any OpenAI client
// does, its task as JSON in TURNPOINT_TASK, and finds its tool at TURNPOINT_TOOLS_URL
// (else it observes on its own). Each step the model acts (a guess, its first number),
// the tool observes (higher, lower, correct or invalid) and the observation goes back as
// a tool message. The last line printed is the transcript.

const task = JSON.parse(process.env.TURNPOINT_TASK);
const baseUrl = process.env.OPENAI_BASE_URL.replace(/\/+$/, "");
const apiKey = process.env.OPENAI_API_KEY;
const toolsUrl = process.env.TURNPOINT_TOOLS_URL;

function observe(action, target) {
  const word = action.split(/\s+/).find((w) => /^[0-9]+$/.test(w));
  if (word === undefined) return "invalid";
  const guess = Number.parseInt(word, 10);
  if (guess === target) return "correct";
  return guess < target ? "higher" : "lower";
}

async function post(url, body) {
  const answer = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(60_000),
  });
  const payload = await answer.json();
  if (!answer.ok) {
    throw new Error(`${url} answered ${answer.status}: ${JSON.stringify(payload.error ?? payload)}`);
  }
  return payload;
}

async function main() {
  const target = Number(task.target);
  const temperature = Number(process.env.HARNESS_TEMPERATURE ?? task.temperature ?? 0);
  const messages = [{ role: "user", content: `range ${task.low} ${task.high}` }];
  for (let step = 0; step < Number(task.max_turns); step += 1) {
    const reply = await post(`${baseUrl}/chat/completions`, {
      model: process.env.OPENAI_MODEL,
      messages,
      max_completion_tokens: Number(task.max_tokens ?? 4),
      temperature,
      seed: Number(task.seed ?? 0) + step,
    });
    const action = reply.choices[0].message.content ?? "";
    const observation = toolsUrl
      ? (await post(`${toolsUrl}/observe`, { action, target, step })).observation
      : observe(action, target);
    messages.push({ role: "assistant", content: action });
    messages.push({ role: "tool", content: String(observation) });
    if (observation === "correct") break;
  }
  console.log(JSON.stringify({ messages }));
}

main().catch((error) => {
  console.error(String(error?.stack ?? error));
  process.exit(1);
});
