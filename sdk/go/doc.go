// Package cbserve is the Go client of cbserve, a continuous-batching LLM inference service
// with a gRPC API (proto/cbserve/v1; the generated stubs are in the gen/cbserve/v1 package).
//
// [NewClient] connects to the generation service:
//
//	client, err := cbserve.NewClient("127.0.0.1:50051")
//	if err != nil { ... }
//	defer client.Close()
//	completion, err := client.Generate(ctx, cbserve.Text("Once upon a time"), cbserve.WithMaxNewTokens(16))
//
// [Client.Generate] returns a whole [Completion]; [Client.Stream] yields its [Chunk]s as they
// come, as a range-over-func iterator (breaking out of the loop cancels the request);
// [Client.Submit] queues a request whose outputs [Client.Results] streams from any token index;
// [Client.Cancel] cancels one. Prompts are [Text], [Tokens] or [Chat]; sampling options
// (WithMaxNewTokens, WithTemperature, ...) left out take the server's defaults, and at most one
// structured-output option ([WithJSONSchema], [WithJSONObject], [WithRegex], [WithGrammar])
// constrains the output.
//
// [WithN] samples n completions from one prompt (parallel sampling): [Client.GenerateN] returns
// them ordered by sequence, Stream and Results interleave the sequences' chunks ([Chunk].Index
// says whose), and [Client.CancelSequence] cancels one sequence while the others run on.
//
// A target may list several replicas ("10.0.0.1:50051,10.0.0.2:50051") or name them all
// ("dns:///cbserve-headless.ns.svc.cluster.local:50051"): calls are spread over them with gRPC's
// round_robin load balancing, and a replica that is unreachable or not SERVING (still loading,
// say) is skipped. Streaming calls get a default deadline ([WithStreamTimeout]), unary calls
// another ([WithDefaultTimeout]); a context's own deadline always wins. Generate, GenerateN and
// Stream are made again on another replica when one fails with [ErrUnavailable] before the server
// took the request; ModelInfo, Cancel and admin Status are retried on it by gRPC's retry policy
// ([WithRetryAttempts]).
//
// [NewAdmin] connects to the admin service (its own port, bearer token): [Admin.Pause] holds
// the engine paused until the returned [PauseLease] is released; [Admin.Stop], [Admin.Start] and
// [Admin.Status] manage and inspect the engine; [Admin.UpdateWeights] streams new weights (raw
// little-endian [Tensor]s) and [Admin.UpdateWeightsFromPath] loads them from a safetensors file
// on the server, both in place, without a restart. After a weight sync, [Admin.ResetPrefixCache]
// drops the prefix cache, and [Admin.WeightsChecksum] returns a digest of the weights served:
// [CheckWeights] compares every replica's (and a trainer's own, from [ChecksumOf]) in one call.
// [WithLogprobsMode] asks for the log-probabilities of the distribution tokens are drawn from
// (after penalties, temperature, top-k, top-p and min-p) rather than of the raw logits, and
// [WithReturnKeptMass] for the log of the mass top-k, top-p and min-p kept, which takes such a
// log-probability back to the whole vocabulary.
//
// Cancelling a call's context cancels the call, and a cancelled Generate or Stream call cancels
// its request on the server. Every error is an [*Error] with the gRPC status code, matching the
// sentinel of its code ([ErrInvalidArgument], [ErrNotFound], ...) with [errors.Is]. A value the
// server would refuse is refused before anything is sent, with the server's own message, which
// names the wire field (sampling.max_new_tokens must be an int >= 1, got 0).
package cbserve
