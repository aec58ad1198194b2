/**
 * Java client of cbserve, a continuous-batching LLM inference service (gRPC).
 *
 * <p>{@link dev.cbserve.client.CbserveClient} generates ({@code generate}, {@code stream}, {@code
 * generateAsync}), queues and follows requests ({@code submit}, {@code results}, {@code cancel})
 * and describes the model ({@code modelInfo}); {@link dev.cbserve.client.CbserveAdminClient}
 * pauses, stops, starts and inspects the engine, and replaces its weights in place ({@code
 * updateWeights} with {@link dev.cbserve.client.Tensor}s, or {@code updateWeightsFromPath}).
 * Failures throw the unchecked {@link dev.cbserve.client.CbserveException} hierarchy. The generated
 * protobuf and gRPC classes (package {@code cbserve.v1}) are in the jar too, for callers who need
 * the raw API.
 */
package dev.cbserve.client;
