/**
 * The `guess` environment's resources server (`--example guess`, per-sibling verifier)
 * or `guess-group` (group-scored), served like `turnpoint serve --kind resources`:
 *
 *     TURNPOINT_TOKEN=... node dist/examples/guess-resources.js --port 0 --root DIR --instance tools
 */
import { GroupGuessTools, GuessTools, VerifierLog } from "./guess-tools.js";
import { serveExample } from "./serve.js";

const code = await serveExample("resources", ["guess", "guess-group"], (args) => {
  const log = new VerifierLog(args.verifierLog);
  return { resources: args.example === "guess" ? new GuessTools(args.instance, log) : new GroupGuessTools(args.instance, log, args.groupSize) };
});
process.exitCode = code;
