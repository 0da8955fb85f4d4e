import { serve } from "@turnpoint/participant";

import { CounterTools } from "./counter.js";

// The token comes from $TURNPOINT_TOKEN (or $TURNPOINT_TOKEN_FILE); SIGTERM drains.
process.exitCode = await serve({ resources: new CounterTools() }, { instance: "counter-tools", root: process.env.SNAPSHOT_ROOT ?? "snapshots" });
