package dev.cbserve.client;

import cbserve.v1.Admin;
import cbserve.v1.AdminServiceGrpc;
import io.grpc.ChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Status;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicReference;

/**
 * A connection to a cbserve server's {@code AdminService} (its own port; every call carries the
 * admin bearer token). Thread-safe; close it when done. Build one with {@link #builder()}, or get
 * the one of a {@link CbserveClient} with {@link CbserveClient#admin()}.
 *
 * <pre>{@code
 * try (CbserveAdminClient admin = CbserveAdminClient.builder()
 *     .target("127.0.0.1:50052").token(System.getenv("CBSERVE_ADMIN_TOKEN")).build()) {
 *   try (PauseLease lease = admin.pause()) {
 *     System.out.println(admin.status());
 *   }
 * }
 * }</pre>
 *
 * <p>A wrong or missing token throws {@link UnauthenticatedException}. Unary calls get the
 * builder's {@code defaultTimeout} (60 s unless set); weight updates have no deadline unless given
 * one.
 */
public final class CbserveAdminClient implements AutoCloseable {
  private final ManagedChannel channel;
  private final String target;
  private final boolean ownsChannel;
  private final Duration defaultTimeout;
  private final AdminServiceGrpc.AdminServiceStub asyncStub;
  private final AdminServiceGrpc.AdminServiceBlockingStub blockingStub;

  CbserveAdminClient(ChannelOptions options) {
    this.channel = options.build();
    this.target = options.target != null ? options.target : channel.authority();
    this.ownsChannel = !options.external();
    this.defaultTimeout = options.defaultTimeout;
    this.asyncStub = AdminServiceGrpc.newStub(channel);
    this.blockingStub = AdminServiceGrpc.newBlockingStub(channel);
  }

  /** A new builder; {@link Builder#target(String)} is required. */
  public static Builder builder() {
    return new Builder();
  }

  /**
   * Pauses the engine in {@link PauseMode#KEEP} mode; see {@link #pause(PauseMode, Duration,
   * Duration)}.
   */
  public PauseLease pause() {
    return pause(PauseMode.KEEP, null, defaultTimeout);
  }

  /** Pauses the engine; see {@link #pause(PauseMode, Duration, Duration)}. */
  public PauseLease pause(PauseMode mode) {
    return pause(mode, null, defaultTimeout);
  }

  /**
   * Pauses the engine for at most {@code lease}; see {@link #pause(PauseMode, Duration, Duration)}.
   */
  public PauseLease pause(PauseMode mode, Duration lease) {
    return pause(mode, lease, defaultTimeout);
  }

  /**
   * Pauses the engine and returns once it is paused: opens the Pause stream and waits for the
   * server's first message. The engine stays paused until the returned lease is closed (or the
   * lease expires, or the connection breaks). Requests added meanwhile are queued and run after
   * the resume.
   *
   * @param mode {@link PauseMode#KEEP} (in-flight requests wait, with their KV cache), {@link
   *     PauseMode#WAIT} (let them finish first) or {@link PauseMode#ABORT} (cancel them)
   * @param lease the longest hold, or null for the server's maximum
   * @param waitTimeout how long to wait for the engine to pause (null: forever); past it the call
   *     is cancelled and {@link DeadlineExceededException} thrown
   */
  public PauseLease pause(PauseMode mode, Duration lease, Duration waitTimeout) {
    Objects.requireNonNull(mode, "mode");
    Admin.PauseRequest.Builder request =
        Admin.PauseRequest.newBuilder().setMode(Convert.pauseMode(mode));
    if (lease != null) {
      request.setLeaseS(Calls.checkTimeout(lease).toNanos() / 1e9);
    }
    if (waitTimeout != null) {
      Calls.checkTimeout(waitTimeout);
    }
    CompletableFuture<PauseLease> first = new CompletableFuture<>();
    AtomicReference<ClientCallStreamObserver<?>> callRef = new AtomicReference<>();
    ClientResponseObserver<Admin.PauseRequest, Admin.PauseResponse> observer =
        new ClientResponseObserver<Admin.PauseRequest, Admin.PauseResponse>() {
          private ClientCallStreamObserver<Admin.PauseRequest> call;
          private PauseLease leaseHandle;

          @Override
          public void beforeStart(ClientCallStreamObserver<Admin.PauseRequest> stream) {
            call = stream;
            callRef.set(stream);
          }

          @Override
          public void onNext(Admin.PauseResponse response) {
            if (leaseHandle == null) {
              leaseHandle =
                  new PauseLease(
                      call,
                      response.getHolders(),
                      response.hasLeaseExpiresAt()
                          ? Convert.instant(response.getLeaseExpiresAt())
                          : null,
                      response.getWeightVersion(),
                      response.getCancelledRequests());
              if (!response.getPaused()) {
                leaseHandle.released();
              }
              first.complete(leaseHandle);
            } else if (!response.getPaused()) {
              leaseHandle.released(); // the lease expired
            }
          }

          @Override
          public void onError(Throwable t) {
            if (leaseHandle != null) {
              leaseHandle.released();
            }
            first.completeExceptionally(Calls.map(t));
          }

          @Override
          public void onCompleted() {
            if (leaseHandle != null) {
              leaseHandle.released();
            }
            first.completeExceptionally(
                new InternalException(
                    Status.Code.UNKNOWN,
                    "the Pause stream ended before the engine was paused",
                    null));
          }
        };
    asyncStub.pause(request.build(), observer);
    try {
      return waitTimeout == null
          ? first.get()
          : first.get(waitTimeout.toNanos(), TimeUnit.NANOSECONDS);
    } catch (TimeoutException e) {
      callRef.get().cancel("gave up waiting for the pause", null);
      throw new DeadlineExceededException(
          "the engine did not pause within "
              + Calls.describe(waitTimeout)
              + " (pause's waitTimeout, the admin client's defaultTimeout unless given); pass a"
              + " longer one (null: none)",
          e);
    } catch (ExecutionException e) {
      throw Calls.map(e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      callRef.get().cancel("interrupted while waiting for the pause", null);
      throw new CancelledException("interrupted while waiting for the pause", e);
    }
  }

  /** A graceful stop; see {@link #stop(boolean, Duration)}. */
  public StopResult stop() {
    return stop(false, null);
  }

  /**
   * Stops the engine, gracefully or ({@code hard}) at once; see {@link #stop(boolean, Duration)}.
   */
  public StopResult stop(boolean hard) {
    return stop(hard, null);
  }

  /**
   * Stops the engine and returns once it has stopped. Graceful ({@code hard = false}): new
   * requests are refused with {@link UnavailableException} and in-flight ones may finish, for up to
   * {@code drainTimeout} (null: the server's default), after which the rest fail. Hard: every
   * pending request fails at once. Idempotent. The call's deadline is the default timeout plus
   * {@code drainTimeout}.
   */
  public StopResult stop(boolean hard, Duration drainTimeout) {
    Admin.StopRequest.Builder request = Admin.StopRequest.newBuilder().setHard(hard);
    Duration deadline = defaultTimeout;
    if (drainTimeout != null) {
      if (drainTimeout.isNegative()) {
        throw new IllegalArgumentException("drainTimeout must be >= 0, got " + drainTimeout);
      }
      request.setDrainTimeoutS(drainTimeout.toNanos() / 1e9);
      if (deadline != null) {
        deadline = deadline.plus(drainTimeout);
      }
    }
    CallTimeout timeout =
        drainTimeout == null
            ? CallTimeout.admin(deadline)
            : CallTimeout.given(deadline, "the admin client's defaultTimeout plus drainTimeout");
    return Convert.stopResult(
        Calls.blocking(
            () -> Calls.withTimeout(blockingStub, timeout).stop(request.build()), timeout));
  }

  /**
   * Starts the engine again after a stop (same model and weights, empty caches).
   *
   * @return true if it was stopped and has started, false if it was already running
   */
  public boolean start() {
    Admin.StartRequest request = Admin.StartRequest.getDefaultInstance();
    CallTimeout timeout = CallTimeout.admin(defaultTimeout);
    return !Calls.blocking(() -> Calls.withTimeout(blockingStub, timeout).start(request), timeout)
        .getAlreadyRunning();
  }

  /**
   * The address this client was built for (its target, or its channel's authority): {@link
   * WeightsChecksums#check(WeightsChecksum, List)} names replicas by it.
   */
  public String target() {
    return target;
  }

  /**
   * Drops every reusable prefix block (TRL's reset_prefix_cache, verl's clear_kv_cache, slime's
   * flush_cache), so that no later request reuses KV computed before the call: by weights a sync
   * just replaced, say. Only an idle server is reset.
   *
   * @param abort cancel the requests in flight (queued or running) first (each ends cancelled),
   *     rather than refuse
   * @throws FailedPreconditionException with requests in flight and {@code abort} false; nothing
   *     was dropped
   */
  public PrefixCacheReset resetPrefixCache(boolean abort) {
    Admin.ResetPrefixCacheRequest request =
        Admin.ResetPrefixCacheRequest.newBuilder().setAbort(abort).build();
    CallTimeout timeout = CallTimeout.admin(defaultTimeout);
    Admin.ResetPrefixCacheResponse response =
        Calls.blocking(
            () -> Calls.withTimeout(blockingStub, timeout).resetPrefixCache(request), timeout);
    return new PrefixCacheReset(response.getDroppedBlocks(), response.getAbortedRequests());
  }

  /**
   * A digest of the weights the server holds (slime's check_weights), computed on its device
   * between two engine steps, with the weight version it is of. Equal weights give equal digests
   * on any device: {@link WeightsChecksums#of(List)} computes the same of {@link Tensor}s, and
   * {@link WeightsChecksums#check(WeightsChecksum, List)} compares replicas. The call takes as long
   * as the server needs to read its whole model once.
   *
   * @param perTensor also return each tensor's digest, to find which differ
   */
  public WeightsChecksum weightsChecksum(boolean perTensor) {
    Admin.GetWeightsChecksumRequest request =
        Admin.GetWeightsChecksumRequest.newBuilder().setPerTensor(perTensor).build();
    CallTimeout timeout = CallTimeout.admin(defaultTimeout);
    Admin.GetWeightsChecksumResponse response =
        Calls.blocking(
            () -> Calls.withTimeout(blockingStub, timeout).getWeightsChecksum(request), timeout);
    Map<String, TensorChecksum> tensors = new TreeMap<>();
    for (Admin.TensorChecksum tensor : response.getTensorsList()) {
      tensors.put(
          tensor.getName(),
          new TensorChecksum(
              tensor.getName(), tensor.getDigest(), tensor.getDtype(), tensor.getShapeList()));
    }
    return new WeightsChecksum(
        response.getDigest(),
        response.getAlgorithm(),
        response.getWeightVersion(),
        response.getNumTensors(),
        tensors);
  }

  /** The engine's state and counters. */
  public EngineStatus status() {
    Admin.GetStatusRequest request = Admin.GetStatusRequest.getDefaultInstance();
    CallTimeout timeout = CallTimeout.admin(defaultTimeout);
    return Convert.engineStatus(
        Calls.blocking(() -> Calls.withTimeout(blockingStub, timeout).getStatus(request), timeout));
  }

  /** {@link #status()} without blocking. */
  public CompletableFuture<EngineStatus> statusAsync() {
    Admin.GetStatusRequest request = Admin.GetStatusRequest.getDefaultInstance();
    CallTimeout timeout = CallTimeout.admin(defaultTimeout);
    return Calls.unary(Calls.withTimeout(asyncStub, timeout)::getStatus, request, timeout)
        .thenApply(Convert::engineStatus);
  }

  /** Replaces weights with {@code tensors}; see {@link #updateWeights(List, String, Duration)}. */
  public WeightsUpdate updateWeights(List<Tensor> tensors) {
    return updateWeights(tensors, null, null);
  }

  /**
   * Replaces weights with {@code tensors}, labelled; see {@link #updateWeights(List, String,
   * Duration)}.
   */
  public WeightsUpdate updateWeights(List<Tensor> tensors, String versionLabel) {
    return updateWeights(tensors, versionLabel, null);
  }

  /**
   * Replaces model weights in place with {@code tensors}, streamed on the UpdateWeights RPC: each
   * tensor in chunks of at most 1 MiB, every chunk carrying the SHA-256 of the whole tensor. The
   * server checks every tensor (known name, equal shape, convertible dtype, complete bytes,
   * checksum) before it changes any weight, then applies the update under a pause of its own:
   * in-flight requests keep their KV cache, and their later tokens come from the new weights
   * ({@link Chunk#weightVersion()}). Concurrent updates are applied one after the other.
   *
   * @param tensors the new values, at least one ({@link Tensor} checks each on construction)
   * @param versionLabel a free-form label of the new weights (e.g. a training step), logged by the
   *     server and returned in {@link WeightsUpdate#versionLabel()}; null for none
   * @param timeout deadline of the whole call, or null for none (the default: a large model takes a
   *     while to stream)
   * @throws IllegalArgumentException when {@code tensors} is empty
   * @throws InvalidArgumentException when the server rejects the update; no weight has changed
   */
  public WeightsUpdate updateWeights(List<Tensor> tensors, String versionLabel, Duration timeout) {
    Objects.requireNonNull(tensors, "tensors");
    if (tensors.isEmpty()) {
      throw new IllegalArgumentException("updateWeights: no tensors to send");
    }
    return send(
        new UpdateWeightsRequests(versionLabel, tensors, UpdateWeightsRequests.MAX_CHUNK_BYTES),
        timeout);
  }

  /**
   * Replaces weights from a safetensors path on the server; see {@link
   * #updateWeightsFromPath(String, String, Duration)}.
   */
  public WeightsUpdate updateWeightsFromPath(String path) {
    return updateWeightsFromPath(path, null, null);
  }

  /**
   * Replaces weights from a safetensors path on the server, labelled; see {@link
   * #updateWeightsFromPath(String, String, Duration)}.
   */
  public WeightsUpdate updateWeightsFromPath(String path, String versionLabel) {
    return updateWeightsFromPath(path, versionLabel, null);
  }

  /**
   * Replaces model weights in place with the tensors of a safetensors file on the server's file
   * system (or of a folder of them, or of a {@code *.safetensors.index.json}): each replaces the
   * parameter of the same name. Checks, label and deadline are as for {@link #updateWeights(List,
   * String, Duration)}.
   *
   * @throws InvalidArgumentException when the server cannot read the path or rejects a tensor; no
   *     weight has changed
   */
  public WeightsUpdate updateWeightsFromPath(String path, String versionLabel, Duration timeout) {
    Objects.requireNonNull(path, "path");
    if (path.isEmpty()) {
      throw new IllegalArgumentException("updateWeightsFromPath: the path is empty");
    }
    return send(UpdateWeightsRequests.fromPath(versionLabel, path), timeout);
  }

  /**
   * Streams {@code requests} as the transport takes them (so a large model is never buffered
   * whole), half-closes, and waits for the server's answer.
   */
  WeightsUpdate send(Iterator<Admin.UpdateWeightsRequest> requests, Duration timeout) {
    if (timeout != null) {
      Calls.checkTimeout(timeout);
    }
    CallTimeout callTimeout = CallTimeout.given(timeout, "the timeout argument");
    CompletableFuture<Admin.UpdateWeightsResponse> answer = new CompletableFuture<>();
    AtomicReference<ClientCallStreamObserver<Admin.UpdateWeightsRequest>> callRef =
        new AtomicReference<>();
    ClientResponseObserver<Admin.UpdateWeightsRequest, Admin.UpdateWeightsResponse> observer =
        new ClientResponseObserver<Admin.UpdateWeightsRequest, Admin.UpdateWeightsResponse>() {
          private boolean halfClosed;

          @Override
          public void beforeStart(ClientCallStreamObserver<Admin.UpdateWeightsRequest> call) {
            callRef.set(call);
            // gRPC runs this handler once the call starts and again whenever the transport can
            // take more, never two at a time.
            call.setOnReadyHandler(
                () -> {
                  while (!halfClosed && call.isReady()) {
                    if (requests.hasNext()) {
                      call.onNext(requests.next());
                    } else {
                      halfClosed = true;
                      call.onCompleted();
                    }
                  }
                });
          }

          @Override
          public void onNext(Admin.UpdateWeightsResponse response) {
            answer.complete(response);
          }

          @Override
          public void onError(Throwable t) {
            answer.completeExceptionally(Calls.map(t, callTimeout));
          }

          @Override
          public void onCompleted() {
            answer.completeExceptionally(
                new InternalException(Status.Code.INTERNAL, "no UpdateWeights response", null));
          }
        };
    Calls.withTimeout(asyncStub, callTimeout).updateWeights(observer);
    try {
      Admin.UpdateWeightsResponse response = answer.get();
      return new WeightsUpdate(
          response.getWeightVersion(), response.getTensorsUpdated(), response.getVersionLabel());
    } catch (ExecutionException e) {
      throw Calls.map(e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      // An update cancelled before its half-close is not applied; one already sent may still be.
      callRef.get().cancel("interrupted while updating weights", null);
      throw new CancelledException("interrupted while updating weights", e);
    }
  }

  /** Closes the channel (open pause leases are released). Idempotent. */
  @Override
  public void close() {
    if (ownsChannel) {
      ChannelShutdown.shutdown(channel);
    }
  }

  /** Builds a {@link CbserveAdminClient}. */
  public static final class Builder {
    private final ChannelOptions options = new ChannelOptions();

    private Builder() {}

    /** The admin address, e.g. {@code "127.0.0.1:50052"}. */
    public Builder target(String target) {
      options.target(target);
      return this;
    }

    /**
     * HTTP/2 keepalive for long calls (a held pause, a weight update); see {@link
     * CbserveClient.Builder#keepAlive(Duration, Duration)}.
     */
    public Builder keepAlive(Duration time, Duration timeout) {
      options.keepAlive(time, timeout);
      return this;
    }

    /** The admin bearer token (the server's {@code CBSERVE_ADMIN_TOKEN}). */
    public Builder token(String token) {
      options.token = token;
      return this;
    }

    /** TLS with the JVM's default trusted roots. */
    public Builder tls() {
      options.tls(null, null, null);
      return this;
    }

    /** TLS trusting the CA certificate(s) in this PEM file. */
    public Builder tls(Path caCertificate) {
      options.tls(Objects.requireNonNull(caCertificate, "caCertificate"), null, null);
      return this;
    }

    /** Mutual TLS (see {@link CbserveClient.Builder#tls(Path, Path, Path)}). */
    public Builder tls(Path caCertificate, Path certificateChain, Path privateKey) {
      options.tls(
          caCertificate,
          Objects.requireNonNull(certificateChain, "certificateChain"),
          Objects.requireNonNull(privateKey, "privateKey"));
      return this;
    }

    /** Any channel credentials. */
    public Builder credentials(ChannelCredentials credentials) {
      options.credentials(credentials);
      return this;
    }

    /** The authority (TLS server name) to use instead of the target's host. */
    public Builder authority(String authority) {
      options.authority = Objects.requireNonNull(authority, "authority");
      return this;
    }

    /** Deadline of unary calls and of the wait for a pause (default 60 s); null for none. */
    public Builder defaultTimeout(Duration timeout) {
      options.defaultTimeout(timeout);
      return this;
    }

    /** Uses this channel instead of building one; the client does not close it. */
    public Builder channel(ManagedChannel channel) {
      options.channel = Objects.requireNonNull(channel, "channel");
      return this;
    }

    /** The client. */
    public CbserveAdminClient build() {
      return new CbserveAdminClient(options);
    }
  }
}
