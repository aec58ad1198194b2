package dev.cbserve.client;

import io.grpc.ChannelCredentials;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.TlsChannelCredentials;
import io.grpc.stub.MetadataUtils;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Path;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.concurrent.TimeUnit;

/**
 * What both clients' builders collect: where to connect (one target, or a list of addresses), how
 * (TLS, token, keepalive), and the default deadlines.
 *
 * <p>Every channel built here gets {@link #serviceConfig(boolean)}: {@code round_robin} over
 * whatever the target resolves to (every A record of a {@code dns:///} name, every address of a
 * list), and gRPC's retries with exponential backoff for the idempotent unary calls. Retries
 * happen inside the call, within its deadline, and only on UNAVAILABLE (nothing was processed).
 * A generation client's channel is also health checked: {@code healthCheckConfig} makes
 * grpc-services' {@code round_robin} (registered over grpc-java's own when grpc-services is on the
 * classpath) count a connection as ready only while the server's {@code grpc.health.v1} status is
 * SERVING, so a replica that is up but still loading, draining or asleep gets no call. An admin
 * client's is not: admin calls are for a replica in any state.
 */
final class ChannelOptions implements Cloneable {
  static final String USER_AGENT = "cbserve-java/0.1.0";
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  /** Tries of an idempotent unary call (the first included). */
  static final int RETRY_ATTEMPTS = 4;

  /**
   * The channels' service config, as grpc-java takes it (JSON numbers as doubles); with {@code
   * healthChecked}, round_robin skips a server whose health is not SERVING. The methods retried are
   * those that change nothing or are idempotent (Cancel of a request twice is a no-op).
   */
  static Map<String, ?> serviceConfig(boolean healthChecked) {
    Map<String, ?> methodConfig =
        Map.of(
            "name",
                List.of(
                    method("cbserve.v1.GenerationService", "GetModelInfo"),
                    method("cbserve.v1.GenerationService", "Cancel"),
                    method("cbserve.v1.AdminService", "GetStatus")),
            "retryPolicy",
                Map.of(
                    "maxAttempts", (double) RETRY_ATTEMPTS,
                    "initialBackoff", "0.1s",
                    "maxBackoff", "2s",
                    "backoffMultiplier", 2.0,
                    "retryableStatusCodes", List.of("UNAVAILABLE")));
    List<Map<String, ?>> balancing = List.of(Map.of("round_robin", Map.of()));
    return healthChecked
        ? Map.of(
            "loadBalancingConfig", balancing,
            "healthCheckConfig", Map.of("serviceName", ""),
            "methodConfig", List.of(methodConfig))
        : Map.of("loadBalancingConfig", balancing, "methodConfig", List.of(methodConfig));
  }

  String target;
  /** Several addresses to balance over (instead of {@link #target}); null when not given. */
  List<String> addresses;
  Duration keepAliveTime;
  Duration keepAliveTimeout;
  String token;
  ChannelCredentials credentials;
  TlsFiles tlsFiles;
  String authority;
  Duration defaultTimeout = Calls.DEFAULT_TIMEOUT;
  Duration streamTimeout = Calls.DEFAULT_STREAM_TIMEOUT;
  /** Whether round_robin skips servers whose health is not SERVING (the generation client's). */
  boolean healthChecked;
  ManagedChannel channel;

  private static Map<String, String> method(String service, String method) {
    return Map.of("service", service, "method", method);
  }

  /** PEM files of a TLS configuration, read when the channel is built. */
  record TlsFiles(Path caCertificate, Path certificateChain, Path privateKey) {}

  void defaultTimeout(Duration timeout) {
    this.defaultTimeout = timeout == null ? null : Calls.checkTimeout(timeout);
  }

  void streamTimeout(Duration timeout) {
    this.streamTimeout = timeout == null ? null : Calls.checkTimeout(timeout);
  }

  void target(String target) {
    this.target = Objects.requireNonNull(target, "target");
    this.addresses = null;
  }

  void addresses(List<String> addresses) {
    List<String> copy = List.copyOf(Objects.requireNonNull(addresses, "addresses"));
    if (copy.isEmpty()) {
      throw new IllegalArgumentException("give at least one address (host:port)");
    }
    StaticAddresses.target(copy); // checks each one
    this.addresses = copy;
    this.target = null;
  }

  void keepAlive(Duration time, Duration timeout) {
    this.keepAliveTime = Calls.checkTimeout(Objects.requireNonNull(time, "time"));
    this.keepAliveTimeout = Calls.checkTimeout(Objects.requireNonNull(timeout, "timeout"));
  }

  void tls(Path caCertificate, Path certificateChain, Path privateKey) {
    if ((certificateChain == null) != (privateKey == null)) {
      throw new IllegalArgumentException("give both the client certificate chain and its key");
    }
    this.tlsFiles = new TlsFiles(caCertificate, certificateChain, privateKey);
    this.credentials = null;
  }

  void credentials(ChannelCredentials credentials) {
    this.credentials = Objects.requireNonNull(credentials, "credentials");
    this.tlsFiles = null;
  }

  ChannelOptions copy() {
    try {
      return (ChannelOptions) super.clone();
    } catch (CloneNotSupportedException e) {
      throw new AssertionError(e);
    }
  }

  /** True when the channel is given (not built, not owned). */
  boolean external() {
    return channel != null;
  }

  /** The channel to use: the given one, or a new one to {@link #target}. */
  ManagedChannel build() {
    if (channel != null) {
      return channel;
    }
    ManagedChannelBuilder<?> builder;
    if (addresses != null) {
      builder =
          Grpc.newChannelBuilder(
              StaticAddresses.target(addresses), channelCredentials(), StaticAddresses.registry());
    } else if (target != null && !target.isEmpty()) {
      builder = Grpc.newChannelBuilder(target, channelCredentials());
    } else {
      throw new IllegalStateException(
          "target is required (e.g. \"127.0.0.1:50051\", \"dns:///cbserve:50051\", or"
              + " targets(\"10.0.0.1:50051\", \"10.0.0.2:50051\"))");
    }
    builder.userAgent(USER_AGENT);
    builder
        .defaultServiceConfig(serviceConfig(healthChecked))
        .disableServiceConfigLookUp()
        .enableRetry();
    if (keepAliveTime != null) {
      builder
          .keepAliveTime(keepAliveTime.toNanos(), TimeUnit.NANOSECONDS)
          .keepAliveTimeout(keepAliveTimeout.toNanos(), TimeUnit.NANOSECONDS)
          .keepAliveWithoutCalls(false);
    }
    if (authority != null) {
      builder.overrideAuthority(authority);
    }
    if (token != null && !token.isEmpty()) {
      Metadata headers = new Metadata();
      headers.put(AUTHORIZATION, "Bearer " + token);
      builder.intercept(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    return builder.build();
  }

  private ChannelCredentials channelCredentials() {
    if (credentials != null) {
      return credentials;
    }
    if (tlsFiles == null) {
      return InsecureChannelCredentials.create();
    }
    TlsChannelCredentials.Builder tls = TlsChannelCredentials.newBuilder();
    try {
      if (tlsFiles.caCertificate() != null) {
        tls.trustManager(tlsFiles.caCertificate().toFile());
      }
      if (tlsFiles.certificateChain() != null) {
        tls.keyManager(tlsFiles.certificateChain().toFile(), tlsFiles.privateKey().toFile());
      }
    } catch (IOException e) {
      throw new UncheckedIOException("cannot read the TLS files " + tlsFiles, e);
    }
    return tls.build();
  }
}
